//! Usage errors: a value the user set that kvgate cannot run with. They exit
//! with code 2 (as clap's own parse errors do) and name what the user set:
//! the flag, or the `KVGATE_…` environment variable when the value came from
//! there (in a Kubernetes manifest there is no flag to look for).

use std::ffi::OsString;
use std::io::IsTerminal;

use clap::error::{ContextKind, ContextValue};
use clap::{CommandFactory, FromArgMatches};

use crate::cli::Cli;

pub use crate::usage_error::{USAGE_EXIT_CODE, UsageError};

/// The exit code for `error`: [`USAGE_EXIT_CODE`] when it is a usage error.
pub fn exit_code(error: &anyhow::Error) -> std::process::ExitCode {
    if error.chain().any(|cause| cause.is::<UsageError>()) {
        std::process::ExitCode::from(USAGE_EXIT_CODE)
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// Parses the command line; on a bad value prints clap's error, naming the
/// environment variable the value came from if it did, and exits with 2.
pub fn parse_cli() -> Cli {
    let args: Vec<OsString> = std::env::args_os().collect();
    let mut command = Cli::command();
    let parsed = command
        .try_get_matches_from_mut(&args)
        .and_then(|mut matches| {
            let mut cli = Cli::from_arg_matches_mut(&mut matches)?;
            if let (crate::cli::Command::Serve(serve), Some(("serve", matches))) =
                (&mut cli.command, matches.subcommand())
            {
                serve.given = given_flags(matches);
            }
            Ok(cli)
        });
    match parsed {
        Ok(cli) => cli,
        Err(error) if !error.use_stderr() => error.exit(),
        Err(error) => {
            let error = error.with_cmd(&command);
            let styled = error.render();
            let rendered = if std::io::stderr().is_terminal() {
                styled.ansi().to_string()
            } else {
                styled.to_string()
            };
            match environment_source(&command, &error, &args) {
                Some(variable) => {
                    let rest = rendered.strip_prefix("error: ").unwrap_or(&rendered);
                    eprint!("error: {variable}: {rest}");
                }
                None => eprint!("{rendered}"),
            }
            std::process::exit(USAGE_EXIT_CODE.into());
        }
    }
}

/// Which of `serve`'s flags the user set rather than left to their default.
fn given_flags(matches: &clap::ArgMatches) -> crate::cli::GivenFlags {
    let given = |id: &str| {
        matches!(
            matches.value_source(id),
            Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
        )
    };
    crate::cli::GivenFlags {
        dp_size: given("dp_size"),
        zmq_topic: given("zmq_topic"),
    }
}

/// `NAME=value` when the refused value came from an environment variable
/// rather than the command line.
fn environment_source(
    command: &clap::Command,
    error: &clap::Error,
    args: &[OsString],
) -> Option<String> {
    let Some(ContextValue::String(flag)) = error.get(ContextKind::InvalidArg) else {
        return None;
    };
    let Some(ContextValue::String(value)) = error.get(ContextKind::InvalidValue) else {
        return None;
    };
    let long = flag.split_whitespace().next()?.strip_prefix("--")?;
    let on_command_line = args.iter().any(|arg| {
        arg.to_str().is_some_and(|arg| {
            arg.strip_prefix("--")
                .is_some_and(|rest| rest == long || rest.starts_with(&format!("{long}=")))
        })
    });
    if on_command_line {
        return None;
    }
    let variable = find_env(command, long)?;
    let set = std::env::var_os(&variable)?;
    (set.to_str() == Some(value.as_str())).then(|| format!("{variable}={value}"))
}

/// The environment variable of flag `--long` in `command` or a subcommand.
fn find_env(command: &clap::Command, long: &str) -> Option<String> {
    command
        .get_arguments()
        .find(|arg| arg.get_long() == Some(long))
        .and_then(|arg| Some(arg.get_env()?.to_string_lossy().into_owned()))
        .or_else(|| {
            command
                .get_subcommands()
                .find_map(|sub| find_env(sub, long))
        })
}
