use clap::Parser;

use kvgate::cli::{Cli, Command};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    kvgate::logging::init(cli.log_format);
    let result = match cli.command {
        Command::Serve(args) => kvgate::app::serve(*args, shutdown_signal()).await,
        Command::Tail(args) => kvgate::tools::tail::run(args).await,
        Command::Status(args) => kvgate::tools::status::run(args).await,
        Command::Bench(args) => kvgate::tools::load::run(args).await,
    };
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
