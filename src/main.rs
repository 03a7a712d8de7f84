use std::time::Duration;

use clap::CommandFactory;
use kvgate::allocator::HugePages;
use kvgate::cli::{Cli, Command};

/// How long tasks still running once a command is done (the gateway already
/// gave them its shutdown grace) may keep the process alive.
const RUNTIME_EXIT_GRACE: Duration = Duration::from_millis(500);

fn main() -> std::process::ExitCode {
    let refused = kvgate::allocator::tune();
    let cli = kvgate::usage::parse_cli();
    // Only the gateway lives long enough, and holds enough, to gain; a
    // client command is not started twice.
    let huge_pages = match cli.command {
        Command::Serve(_) => kvgate::allocator::restart_asking_for_huge_pages(),
        _ => HugePages::NothingToAsk,
    };
    kvgate::logging::init(cli.log_format);
    if !refused.is_empty() {
        tracing::warn!(?refused, "malloc kept its defaults for these parameters");
    }
    match huge_pages {
        HugePages::RestartFailed(error) => {
            tracing::info!(%error, "{}", kvgate::allocator::RESTART_FAILED);
        }
        HugePages::NotTaken { restarts } => {
            tracing::info!(restarts, "{}", kvgate::allocator::NOT_TAKEN);
        }
        HugePages::Asking { restarts } => {
            tracing::debug!(
                restarts,
                "malloc asks for huge pages for every heap it makes"
            );
        }
        HugePages::Unchecked { restarts } => {
            tracing::debug!(
                restarts,
                "started again asking for huge pages; whether malloc asks cannot be read from /proc"
            );
        }
        HugePages::NothingToAsk => {}
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    // The gateway's and the index's runtime shapes are measured (a wake-up
    // of another worker per delivery or query cost more than the
    // parallelism gave: BENCHMARKS.md, "One worker thread", "The fleet
    // index");
    // the client commands keep tokio's one worker per core.
    match &cli.command {
        Command::Serve(args) => {
            builder.worker_threads(args.worker_threads as usize);
        }
        Command::Index(args) => {
            builder.worker_threads(args.worker_threads as usize);
        }
        _ => {}
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvgate: cannot start the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Serve(args) => kvgate::app::serve(*args, shutdown_signal()).await,
            Command::Index(args) => kvgate::app::index::run(*args, shutdown_signal()).await,
            Command::Tail(args) => kvgate::tools::tail::run(args).await,
            Command::Record(args) => kvgate::tools::record::run(*args, shutdown_signal()).await,
            Command::Status(args) => kvgate::tools::status::run(args).await,
            Command::Completions(args) => kvgate::tools::shell::completions(args, Cli::command()),
            Command::Man(args) => kvgate::tools::shell::man(args, Cli::command()),
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

/// SIGINT or SIGTERM. The handlers are installed when this is called, not
/// when the future is first polled: a signal that arrives while the gateway
/// is still starting (after it announced its address) must stop it cleanly
/// rather than kill it.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let interrupt = signal(SignalKind::interrupt());
    let terminate = signal(SignalKind::terminate());
    async move {
        match (interrupt, terminate) {
            (Ok(mut interrupt), Ok(mut terminate)) => {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
            }
            // Without handlers (never on Linux), the default actions apply.
            _ => std::future::pending().await,
        }
    }
}
