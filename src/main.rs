use std::time::Duration;

use kvgate::cli::Command;

/// How long tasks still running once a command is done (the gateway already
/// gave them its shutdown grace) may keep the process alive.
const RUNTIME_EXIT_GRACE: Duration = Duration::from_millis(500);

fn main() -> std::process::ExitCode {
    let cli = kvgate::usage::parse_cli();
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
            Command::Serve(args) => kvgate::app::serve(*args, shutdown_signal()).await,
            Command::Tail(args) => kvgate::tools::tail::run(args).await,
            Command::Status(args) => kvgate::tools::status::run(args).await,
            Command::Bench(args) => kvgate::tools::load::run(args).await,
            Command::Completions(args) => kvgate::tools::shell::completions(args),
            Command::Man => kvgate::tools::shell::man(),
        }
    });
    // Dropping the runtime would wait for a task stuck in a loop forever.
    runtime.shutdown_timeout(RUNTIME_EXIT_GRACE);
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvgate: {error:#}");
            kvgate::usage::exit_code(&error)
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
