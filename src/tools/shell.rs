//! `kvgate completions SHELL` and `kvgate man`: shell completions and a
//! roff man page generated from the command-line definition itself, so they
//! never disagree with `--help`.

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Writes the completion script of `command` (the whole command line,
/// given by the caller so this module need not know it) for `args.shell`
/// to stdout.
pub fn completions(args: CompletionsArgs, mut command: clap::Command) -> anyhow::Result<()> {
    clap_complete::generate(args.shell, &mut command, "kvgate", &mut std::io::stdout());
    Ok(())
}

/// Writes the man page of `command` and every subcommand (roff) to stdout.
pub fn man(command: clap::Command) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    clap_mangen::Man::new(command.clone()).render(&mut out)?;
    for sub in command.get_subcommands() {
        let name = format!("kvgate-{}", sub.get_name());
        let sub = sub
            .clone()
            .display_name(name)
            .version(env!("CARGO_PKG_VERSION"));
        clap_mangen::Man::new(sub).render(&mut out)?;
    }
    Ok(())
}
