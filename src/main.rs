use kvgate::cli::Command;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = kvgate::usage::parse_cli();
    kvgate::logging::init(cli.log_format);
    let result = match cli.command {
        Command::Serve(args) => kvgate::app::serve(args, shutdown_signal()).await,
        Command::Tail(args) => kvgate::tools::tail::run(args).await,
        Command::Status(args) => kvgate::tools::status::run(args).await,
        Command::Bench(args) => kvgate::tools::load::run(args).await,
        Command::Completions(args) => kvgate::tools::shell::completions(args),
        Command::Man => kvgate::tools::shell::man(),
    };
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
