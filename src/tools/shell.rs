//! `kvgate completions SHELL` and `kvgate man`: shell completions and roff
//! man pages generated from the command-line definition itself, so they
//! never disagree with `--help`.
//!
//! Invariant: one page per command (kvgate(1), kvgate-serve(1), ...), each
//! with ENVIRONMENT and EXIT STATUS; a page's SEE ALSO names only pages
//! `kvgate man --dir` writes.

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

#[derive(Debug, Clone, clap::Args)]
#[allow(missing_docs)] // clap would show a doc comment as help text
pub struct ManArgs {
    /// The command whose page to print: serve, tail, status, completions or
    /// man (kvgate's own page when not given).
    #[arg(value_name = "COMMAND")]
    pub command: Option<String>,
    /// Write every page (kvgate.1, kvgate-serve.1, ...) into this directory
    /// instead of printing one, e.g. ~/.local/share/man/man1; `man
    /// kvgate-serve` then finds them.
    #[arg(long, value_name = "DIR", conflicts_with = "command")]
    pub dir: Option<std::path::PathBuf>,
}

/// What each exit code means, for every page.
const EXIT_STATUS: [(&str, &str); 3] = [
    (
        "0",
        "Success: serve stopped by SIGTERM or SIGINT; status found the gateway SERVING; \
         tail reached the end of the stream, its --limit, or a reader that went away.",
    ),
    (
        "1",
        "Failure at run time: a task of serve failed (the orchestrator should restart it) or \
         a port could not be bound; status could not reach the gateway or found it not \
         SERVING; tail was refused or its stream ended with an error.",
    ),
    (
        "2",
        "Usage error: a bad flag, environment variable or combination, or a file a flag names \
         that is missing, empty or unusable. Nothing was started.",
    ),
];

/// Text for roff: backslashes and hyphens escaped, no line taken for a
/// request.
fn roff(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    match escaped.chars().next() {
        Some('.' | '\'') => format!("\\&{escaped}"),
        _ => escaped,
    }
}

/// The variables a page documents: each argument's `KVGATE_…` and the flag
/// it stands for, in the order of `commands`.
fn environment(commands: &[&clap::Command]) -> String {
    let mut out = String::from(".SH ENVIRONMENT\n");
    let mut seen = std::collections::BTreeSet::new();
    for command in commands {
        for arg in command.get_arguments() {
            let (Some(env), Some(long)) = (arg.get_env(), arg.get_long()) else {
                continue;
            };
            let env = env.to_string_lossy().into_owned();
            if seen.insert(env.clone()) {
                out.push_str(&format!(
                    ".TP\n\\fB{}\\fR\nSets \\fB{}\\fR (flags win over variables).\n",
                    roff(&env),
                    roff(&format!("--{long}"))
                ));
            }
        }
    }
    out.push_str(
        ".TP\n\\fBRUST_LOG\\fR\nFilters the log on stderr, e.g. RUST_LOG=kvgate=debug \
         (default: info).\n",
    );
    if commands.iter().any(|command| command.get_name() == "serve") {
        out.push_str(&format!(
            ".TP\n\\fBGLIBC_TUNABLES\\fR\n{}\n.TP\n\\fBKVGATE_HUGE_PAGE_RESTARTS\\fR\n{}\n",
            roff(
                "kvgate serve adds glibc.malloc.hugetlb=1 where the kernel gives transparent \
                 huge pages only to memory that asks, and starts itself again (same arguments, \
                 name and pid); a value that already names glibc.malloc.hugetlb is kept as set \
                 (=0 keeps the heap on the kernel's default pages)."
            ),
            roff(
                "Set by kvgate serve on itself as it starts again for huge pages: how many \
                 restarts glibc took to ask for them (at most 32). Not a setting."
            )
        ));
    }
    out
}

fn exit_status() -> String {
    let mut out = String::from(".SH \"EXIT STATUS\"\n");
    for (code, meaning) in EXIT_STATUS {
        out.push_str(&format!(".TP\n\\fB{code}\\fR\n{}\n", roff(meaning)));
    }
    out
}

/// One page: clap's sections, then ENVIRONMENT, EXIT STATUS and SEE ALSO.
fn page(
    command: &clap::Command,
    variables: &[&clap::Command],
    see_also: &[String],
) -> anyhow::Result<Vec<u8>> {
    let man = clap_mangen::Man::new(command.clone());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    man.render_options_section(&mut out)?;
    if command.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    out.extend_from_slice(environment(variables).as_bytes());
    out.extend_from_slice(exit_status().as_bytes());
    if !see_also.is_empty() {
        let pages: Vec<String> = see_also
            .iter()
            .map(|page| format!("\\fB{}\\fR(1)", roff(page)))
            .collect();
        out.extend_from_slice(format!(".SH \"SEE ALSO\"\n{}\n", pages.join(", ")).as_bytes());
    }
    man.render_version_section(&mut out)?;
    if !out.ends_with(b"\n") {
        out.push(b'\n');
    }
    Ok(out)
}

/// Every page of `command` (the whole command line, given by the caller):
/// `(file name, roff)`, kvgate's own first. kvgate(1) documents every
/// variable; each command's page its own and the global ones.
fn pages(command: clap::Command) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut root = command
        .disable_help_subcommand(true)
        .version(env!("CARGO_PKG_VERSION"));
    root.build();
    let subcommands: Vec<clap::Command> = root
        .get_subcommands()
        .map(|sub| {
            sub.clone()
                .display_name(format!("kvgate-{}", sub.get_name()))
                .version(env!("CARGO_PKG_VERSION"))
        })
        .collect();
    let names: Vec<String> = subcommands
        .iter()
        .map(|sub| format!("kvgate-{}", sub.get_name()))
        .collect();
    let everything: Vec<&clap::Command> = std::iter::once(&root).chain(&subcommands).collect();
    let mut pages = vec![("kvgate.1".to_owned(), page(&root, &everything, &names)?)];
    for (sub, name) in subcommands.iter().zip(&names) {
        pages.push((
            format!("{name}.1"),
            page(sub, &[sub, &root], &["kvgate".to_owned()])?,
        ));
    }
    Ok(pages)
}

/// `kvgate man`: prints kvgate(1) or one command's page, or writes every
/// page into `--dir`.
pub fn man(args: ManArgs, command: clap::Command) -> anyhow::Result<()> {
    let pages = pages(command)?;
    if let Some(dir) = args.dir {
        std::fs::create_dir_all(&dir)
            .map_err(|error| anyhow::anyhow!("--dir {}: {error}", dir.display()))?;
        for (name, roff) in &pages {
            let path = dir.join(name);
            std::fs::write(&path, roff).map_err(|error| {
                anyhow::anyhow!("--dir: cannot write {}: {error}", path.display())
            })?;
        }
        return Ok(());
    }
    let wanted = match &args.command {
        Some(command) => format!("kvgate-{command}.1"),
        None => "kvgate.1".to_owned(),
    };
    let Some((_, roff)) = pages.iter().find(|(name, _)| *name == wanted) else {
        let known: Vec<&str> = pages
            .iter()
            .filter_map(|(name, _)| name.strip_prefix("kvgate-")?.strip_suffix(".1"))
            .collect();
        return Err(crate::usage_error::UsageError(format!(
            "kvgate man {}: no such command (one of {})",
            args.command.unwrap_or_default(),
            known.join(", ")
        ))
        .into());
    };
    super::print(&String::from_utf8_lossy(roff))
}
