use std::time::Duration;

use clap::Parser;

use kvgate::cli::{Cli, Command};

/// How long tasks still running once a command is done (the gateway already
/// gave them its shutdown grace) may keep the process alive.
const RUNTIME_EXIT_GRACE: Duration = Duration::from_millis(500);

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    kvgate::logging::init(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvgate: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => kvgate::app::serve(args, shutdown_signal()).await,
            Command::Tail(args) => kvgate::tools::tail::run(args).await,
            Command::Status(args) => kvgate::tools::status::run(args).await,
            Command::Bench(args) => kvgate::tools::load::run(args).await,
        }
    });
    // Dropping the runtime would wait for a task stuck in a loop forever.
    runtime.shutdown_timeout(RUNTIME_EXIT_GRACE);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvgate: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
