//! The documents a newcomer reads agree with the project: the wire contract
//! in `docs/` is the shared spec's, the licence file is the one Cargo.toml
//! names, every replay-port example keeps the bases `--dp-size` apart, the
//! reference's tables are the flags' own, the README stays a short first
//! page, `--version` names its commit, and no file dates the work.

use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|error| panic!("{path}: {error}"))
}

#[test]
fn docs_contract_starts_with_the_shared_spec_and_ends_with_kvgates_additions() {
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/spec/contract.md");
    // Only where the shared spec is checked out next to the repository.
    let Ok(spec) = std::fs::read_to_string(&shared) else {
        eprintln!("SKIPPED: {} not found", shared.display());
        return;
    };
    let ours = read("docs/contract.md");
    let Some(additions) = ours.strip_prefix(&spec) else {
        panic!("docs/contract.md does not start with ../shared/spec/contract.md: copy it again")
    };
    assert!(
        additions.is_empty() || additions.starts_with("\n## kvgate's additions\n"),
        "after the shared text, docs/contract.md holds only its last section, \"kvgate's additions\""
    );
    assert_eq!(
        additions.matches("\n## ").count(),
        usize::from(!additions.is_empty()),
        "\"kvgate's additions\" is the last section"
    );
}

#[test]
fn the_license_file_is_the_apache_2_0_text_cargo_toml_names() {
    assert!(read("Cargo.toml").contains("license = \"Apache-2.0\""));
    let license = read("LICENSE");
    assert!(license.contains("Apache License") && license.contains("Version 2.0, January 2004"));
    assert!(license.contains("END OF TERMS AND CONDITIONS"));
}

/// Every `tcp://*:PORT` the text gives for publishers, for replay and for
/// load publishers.
fn example_ports(text: &str) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut publishers = Vec::new();
    let mut replays = Vec::new();
    let mut loads = Vec::new();
    for line in text.lines() {
        let mut rest = line;
        while let Some(at) = rest.find("tcp://*:") {
            let before = &rest[..at];
            let digits: String = rest[at + 8..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(port) = digits.parse() {
                if before.contains("replay") || before.to_ascii_uppercase().contains("REPLAY") {
                    replays.push(port);
                } else if before.contains("load") {
                    loads.push(port);
                } else {
                    publishers.push(port);
                }
            }
            rest = &rest[at + 8..];
        }
    }
    (publishers, replays, loads)
}

#[test]
fn replay_port_examples_agree_everywhere_and_state_the_spacing_rule() {
    let help = {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(["serve", "--help"])
            .output()
            .unwrap();
        String::from_utf8(output.stdout).unwrap()
    };
    for (name, text) in [
        ("docs/engines.md", read("docs/engines.md")),
        (
            "deploy/kubernetes-sidecar.yaml",
            read("deploy/kubernetes-sidecar.yaml"),
        ),
        ("kvgate serve --help", help),
    ] {
        assert!(
            text.contains("at least --dp-size apart")
                || text.contains("at least `--dp-size` apart"),
            "{name} does not state the rule"
        );
        let (publishers, replays, loads) = example_ports(&text);
        assert!(!replays.is_empty(), "{name} has no replay example");
        // Port 0: each rank binds an ephemeral port, which kvgate learns
        // by asking the engine.
        for port in publishers.into_iter().filter(|&port| port != 0) {
            assert_eq!(port, 5557, "{name}: publisher base");
        }
        for port in replays.into_iter().filter(|&port| port != 0) {
            assert_eq!(port, 5567, "{name}: replay base");
        }
        // SGLang's `--load-publish-endpoint auto` with one rank: KV base + 1.
        for port in loads {
            assert_eq!(port, 5558, "{name}: load publisher base");
        }
    }
}

#[test]
fn completions_and_the_man_page_cover_every_subcommand_and_flag() {
    let kvgate = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "kvgate {args:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    for shell in ["bash", "zsh", "fish"] {
        let script = kvgate(&["completions", shell]);
        for word in ["serve", "tail", "status", "zmq-endpoint", "max-batch-bytes"] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
    let man = kvgate(&["man"]);
    assert!(man.contains(".TH kvgate 1"), "{man}");
    assert_eq!(
        man.matches(".TH ").count(),
        1,
        "one page, not several joined"
    );
    let serve = kvgate(&["man", "serve"]);
    for section in [
        ".TH kvgate-serve 1",
        "zmq\\-replay\\-endpoint",
        "KVGATE_ZMQ_REPLAY_ENDPOINT",
    ] {
        assert!(serve.contains(section), "kvgate-serve(1) lacks {section}");
    }
    assert!(kvgate(&["man", "tail"]).contains(".TH kvgate-tail 1"));
}

#[test]
fn every_man_page_has_environment_and_exit_status_and_sees_only_pages_written() {
    let dir = std::env::temp_dir().join(format!("kvgate-man-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(["man", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let mut written: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    let pages: Vec<(String, String)> = written
        .iter()
        .map(|name| {
            (
                name.clone(),
                std::fs::read_to_string(dir.join(name)).unwrap(),
            )
        })
        .collect();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        written,
        [
            "kvgate-completions.1",
            "kvgate-index.1",
            "kvgate-man.1",
            "kvgate-record.1",
            "kvgate-serve.1",
            "kvgate-status.1",
            "kvgate-tail.1",
            "kvgate.1"
        ]
    );
    for (name, page) in &pages {
        for section in [
            ".SH ENVIRONMENT",
            ".SH \"EXIT STATUS\"",
            "KVGATE_LOG_FORMAT",
            "RUST_LOG",
        ] {
            assert!(page.contains(section), "{name} lacks {section}");
        }
        // Every page another page refers to, as `name(1)`, was written.
        for (at, _) in page.match_indices("(1)") {
            let before = &page[..at];
            let start = before
                .rfind(|c: char| c.is_whitespace() || c == '>')
                .map_or(0, |i| i + 1);
            let referred = before[start..]
                .replace("\\fB", "")
                .replace("\\fR", "")
                .replace("\\-", "-");
            assert!(
                written.contains(&format!("{referred}.1")),
                "{name} refers to {referred}(1), which kvgate man --dir does not write"
            );
        }
    }
    let page_of = |name: &str| &pages.iter().find(|(page, _)| page == name).unwrap().1;
    let kvgate_1 = page_of("kvgate.1");
    for variable in ["KVGATE_LISTEN", "KVGATE_ADDR", "KVGATE_DEMO"] {
        assert!(kvgate_1.contains(variable), "kvgate(1) lacks {variable}");
    }
    // The heap's variables are the gateway's: kvgate(1) and
    // kvgate-serve(1) say them, a client command's page does not.
    for variable in ["GLIBC_TUNABLES", "KVGATE_HUGE_PAGE_RESTARTS"] {
        assert!(kvgate_1.contains(variable), "kvgate(1) lacks {variable}");
        assert!(page_of("kvgate-serve.1").contains(variable));
        assert!(!page_of("kvgate-status.1").contains(variable));
    }
}

/// Whether `kvgate serve` takes `value` for the numeric flag `arg`. The
/// value goes in as the flag's default: clap's value parser checks it all
/// the same, and a default is no flag given, so a flag that requires
/// another is probed alone. (A default must live as long as the command:
/// each probe leaks a few bytes, in a test only.)
fn serve_accepts(serve: &clap::Command, arg: &clap::Arg, value: &str) -> bool {
    let value: &'static str = Box::leak(value.to_owned().into_boxed_str());
    serve
        .clone()
        .mut_arg(arg.get_id(), |arg| {
            arg.env(None::<&str>).default_value(value)
        })
        .try_get_matches_from(["serve"])
        .is_ok()
}

/// The values a numeric flag takes, found by bisection around its default:
/// `(lowest, highest)`, `None` for no upper bound.
fn numeric_range(serve: &clap::Command, arg: &clap::Arg, default: u64) -> (u64, Option<u64>) {
    let accepts = |value: u64| serve_accepts(serve, arg, &value.to_string());
    assert!(accepts(default), "--{} refuses its default", arg.get_id());
    let lowest = if accepts(0) {
        0
    } else {
        let (mut refused, mut taken) = (0, default);
        while taken - refused > 1 {
            let middle = refused + (taken - refused) / 2;
            if accepts(middle) {
                taken = middle;
            } else {
                refused = middle;
            }
        }
        taken
    };
    let highest = (!accepts(u64::MAX)).then(|| {
        let (mut taken, mut refused) = (default, u64::MAX);
        while refused - taken > 1 {
            let middle = taken + (refused - taken) / 2;
            if accepts(middle) {
                taken = middle;
            } else {
                refused = middle;
            }
        }
        taken
    });
    (lowest, highest)
}

/// `docs/options.md`'s `kvgate serve` options table, made from clap's model of the
/// command line: flag, variable, default, the range the flag's parser
/// takes (probed) and its help text.
fn options_table() -> String {
    use clap::CommandFactory;
    let cli = kvgate::cli::Cli::command();
    let serve = cli.find_subcommand("serve").expect("kvgate serve").clone();
    let mut table =
        String::from("| flag | env | default | range | meaning |\n|---|---|---|---|---|\n");
    for arg in cli.get_arguments().chain(serve.get_arguments()) {
        let Some(long) = arg.get_long() else { continue };
        if arg.is_hide_set() || ["help", "version"].contains(&long) {
            continue;
        }
        let env = arg
            .get_env()
            .map(|env| format!("`{}`", env.to_string_lossy()))
            .unwrap_or_else(|| "—".into());
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|value| value.to_string_lossy().into_owned())
            .collect();
        let default = match (defaults.first().map(String::as_str), arg.get_action()) {
            (_, clap::ArgAction::SetTrue) => "off".to_owned(),
            (None, _) => "—".to_owned(),
            (Some(""), _) => "empty".to_owned(),
            (Some(_), _) => format!("`{}`", defaults.join(",")),
        };
        let size = |text: &str| kvgate::cli_values::parse_byte_size(text).ok();
        let range = match defaults.first().map(String::as_str) {
            Some(text) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
                let (low, high) = numeric_range(&serve, arg, text.parse().unwrap());
                match high {
                    Some(high) => format!("{low}–{high}"),
                    None => format!("≥ {low}"),
                }
            }
            Some(text) if size(text).is_some() => {
                let format = kvgate::cli_values::format_byte_size;
                match numeric_range(&serve, arg, size(text).unwrap()) {
                    (low, Some(high)) => format!("{}–{}", format(low), format(high)),
                    (low, None) => format!("≥ {}", format(low)),
                }
            }
            _ => {
                let values: Vec<String> = arg
                    .get_possible_values()
                    .iter()
                    .filter(|_| arg.get_action().takes_values())
                    .map(|value| format!("`{}`", value.get_name()))
                    .collect();
                if values.is_empty() {
                    "—".to_owned()
                } else {
                    values.join(", ")
                }
            }
        };
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|help| help.to_string())
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('|', "\\|");
        table.push_str(&format!(
            "| `--{long}` | {env} | {default} | {range} | {help} |\n"
        ));
    }
    table
}

const OPTIONS_BEGIN: &str = "<!-- kvgate serve options: generated from the flags; KVGATE_BLESS=1 cargo test --test docs rewrites it -->\n";
const OPTIONS_END: &str = "<!-- end of kvgate serve options -->\n";

/// The page of the reference that holds the generated options table.
const OPTIONS_PAGE: &str = "docs/options.md";

#[test]
fn the_options_page_table_is_the_one_the_flags_make() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(OPTIONS_PAGE);
    let page = read(OPTIONS_PAGE);
    let begin = page
        .find(OPTIONS_BEGIN)
        .unwrap_or_else(|| panic!("{OPTIONS_PAGE} marks its options table"))
        + OPTIONS_BEGIN.len();
    let end = begin
        + page[begin..]
            .find(OPTIONS_END)
            .unwrap_or_else(|| panic!("{OPTIONS_PAGE} marks the end of its options table"));
    let table = options_table();
    if page[begin..end] == table {
        return;
    }
    if std::env::var_os("KVGATE_BLESS").is_some() {
        let updated = format!("{}{table}{}", &page[..begin], &page[end..]);
        std::fs::write(&path, updated).unwrap();
        eprintln!("{OPTIONS_PAGE}: options table rewritten from the flags");
        return;
    }
    panic!(
        "{OPTIONS_PAGE}'s options table differs from the flags (kvgate serve --help); \
         regenerate it with `KVGATE_BLESS=1 cargo test --test docs`:\n{table}"
    );
}

/// A figure as the documents write it in a table: `512`, `1 MiB`, `1000 ms`,
/// `10M`.
fn amount(cell: &str) -> Option<u64> {
    let cell = cell.trim().trim_end_matches(" ms").trim_end_matches(" s");
    kvgate::cli_values::parse_byte_size(&cell.replace(' ', "")).ok()
}

/// The README and every page of `docs/`, by path.
fn documents() -> Vec<(String, String)> {
    let mut paths = vec!["README.md".to_owned()];
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs");
    for entry in std::fs::read_dir(docs).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") {
            paths.push(format!("docs/{name}"));
        }
    }
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = read(&path);
            (path, text)
        })
        .collect()
}

#[test]
fn every_default_and_range_the_documents_give_a_flag_elsewhere_is_the_flags_own() {
    use clap::CommandFactory;
    let cli = kvgate::cli::Cli::command();
    let serve = cli.find_subcommand("serve").expect("kvgate serve").clone();
    let mut checked = 0;
    for (path, text) in documents() {
        checked += check_flag_rows(&serve, &path, &text);
    }
    // The guarantees page alone holds dozens of bounds.
    assert!(checked >= 10, "found only {checked} figures to check");
}

/// Checks every table row of `text` outside the generated options table
/// that names a serve flag: its default and ranges are the flag's own.
/// Returns how many figures it checked.
fn check_flag_rows(serve: &clap::Command, path: &str, text: &str) -> usize {
    let generated = match (text.find(OPTIONS_BEGIN), text.find(OPTIONS_END)) {
        (Some(begin), Some(end)) => begin..end,
        _ => 0..0,
    };
    let mut checked = 0;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let at = offset;
        offset += line.len();
        if generated.contains(&at) || !line.starts_with('|') {
            continue;
        }
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let Some(flag_cell) = cells.iter().position(|cell| cell.starts_with("`--")) else {
            continue;
        };
        let long = cells[flag_cell][3..].split('`').next().unwrap();
        // A row of a serve flag (other tables quote messages or tools' flags).
        let Some(arg) = serve
            .get_arguments()
            .find(|arg| arg.get_long() == Some(long))
        else {
            continue;
        };
        let default = arg
            .get_default_values()
            .first()
            .and_then(|value| amount(&value.to_string_lossy()));
        let mut default_seen = false;
        for cell in &cells[flag_cell + 1..] {
            if cell.starts_with("`KVGATE_") {
                continue;
            }
            if let Some(bound) = cell.strip_prefix("≥ ") {
                let (low, high) = numeric_range(serve, arg, default.unwrap());
                assert_eq!(
                    (amount(bound), high),
                    (Some(low), None),
                    "--{long}: {path} says {cell}: {line}"
                );
            } else if let Some((low, high)) = cell.split_once('–') {
                let (lowest, highest) = numeric_range(serve, arg, default.unwrap());
                assert_eq!(
                    (amount(low), amount(high)),
                    (Some(lowest), highest),
                    "--{long}: {path} says {cell}: {line}"
                );
            } else if let Some(figure) = amount(cell).filter(|_| !default_seen) {
                assert_eq!(
                    Some(figure),
                    default,
                    "--{long}'s default in {path}: {line}"
                );
                default_seen = true;
            } else {
                break;
            }
            checked += 1;
        }
    }
    checked
}

/// The figures of a text: every run of digits with its decimal part
/// (`0.46`, `3.29`, `121`).
fn figures(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut current = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() || (c == '.' && !current.is_empty()) {
            current.push(c);
        } else if !current.is_empty() {
            found.push(current.trim_end_matches('.').to_owned());
            current.clear();
        }
    }
    found
}

#[test]
fn every_performance_figure_in_the_readme_is_one_of_the_current_targets_table() {
    let readme = read("README.md");
    let section = readme
        .split("## Performance\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("README.md has a Performance section");
    let benchmarks = read("BENCHMARKS.md");
    let current = benchmarks
        .split("## Current targets\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("BENCHMARKS.md has a Current targets section");
    let table = figures(current);
    // The sentences' own numbers (2-core, 1M blocks, 20k events/s, targets
    // of 3M and 5M, 16-token blocks, subscriber counts) are in the table's
    // row names too.
    let missing: Vec<String> = figures(section)
        .into_iter()
        .filter(|figure| !table.contains(figure))
        .collect();
    assert!(
        missing.is_empty(),
        "README.md's Performance figures missing from BENCHMARKS.md's Current targets: {missing:?}"
    );
}

#[test]
fn kvgate_version_says_the_version_and_the_commit_it_was_built_from() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let commit = kvgate::metrics::GIT_COMMIT;
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        format!("kvgate {} ({commit})\n", env!("CARGO_PKG_VERSION"))
    );
    // Built in a checkout without an explicit KVGATE_GIT_COMMIT, the commit
    // is the checkout's HEAD (build.rs reruns when HEAD or its ref moves).
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|output| output.status.success());
    match head {
        Some(head) if std::env::var_os("KVGATE_GIT_COMMIT").is_none() => {
            let head = String::from_utf8(head.stdout).unwrap();
            assert!(
                commit.len() >= 7 && head.starts_with(commit),
                "built from {commit}, HEAD is {head}"
            );
        }
        _ => eprintln!("SKIPPED: not a git checkout, or KVGATE_GIT_COMMIT set"),
    }
}

#[test]
fn a_newcomer_finds_the_two_commands_on_the_first_screen_of_a_short_readme() {
    let readme = read("README.md");
    let first_screen: Vec<&str> = readme.lines().take(30).collect();
    for command in ["make run", "make test"] {
        assert!(
            first_screen.iter().any(|line| line.starts_with(command)),
            "README.md's first 30 lines do not show `{command}`"
        );
    }
    let lines = readme.lines().count();
    assert!(
        lines < 400,
        "README.md has {lines} lines: move reference to docs/"
    );
}

#[test]
fn every_link_between_the_documents_reaches_a_file() {
    let mut documents = documents();
    for path in ["BENCHMARKS.md", "CHANGELOG.md"] {
        documents.push((path.to_owned(), read(path)));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for (path, text) in &documents {
        let dir = root.join(path).parent().unwrap().to_owned();
        for (at, _) in text.match_indices("](") {
            let target: String = text[at + 2..].chars().take_while(|&c| c != ')').collect();
            let file = target.split('#').next().unwrap();
            if file.is_empty() || file.contains("://") {
                continue;
            }
            assert!(
                dir.join(file).exists(),
                "{path} links to {target}, which does not exist"
            );
            checked += 1;
        }
    }
    assert!(checked >= 10, "found only {checked} links");
}

/// Every file the repository tracks: `git ls-files` in a checkout, else
/// every file under the crate's directory but `target/` and `.git/`.
fn tracked_files() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let listed = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|output| output.status.success() && !output.stdout.is_empty());
    if let Some(listed) = listed {
        return listed
            .stdout
            .split(|&byte| byte == 0)
            .filter(|name| !name.is_empty())
            .map(|name| root.join(String::from_utf8_lossy(name).as_ref()))
            .collect();
    }
    let mut files = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy();
            if path.is_dir() {
                if name != "target" && name != ".git" {
                    dirs.push(path);
                }
            } else {
                files.push(path);
            }
        }
    }
    files
}

/// Whether `line` dates the work by the sitting it was done in: the word
/// for a sitting, singular or plural, a space and a digit, in any case
/// (what `git grep -inE 'sessions? [0-9]'` would find).
fn dates_the_work(line: &str, word: &str) -> bool {
    let line = line.to_lowercase();
    line.match_indices(word).any(|(at, _)| {
        let rest = &line[at + word.len()..];
        let rest = rest.strip_prefix('s').unwrap_or(rest);
        rest.strip_prefix(' ')
            .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
    })
}

#[test]
fn no_tracked_file_dates_the_work_by_the_sitting_it_was_done_in() {
    // Built here so that this file does not match its own pattern.
    let word = ["ses", "sion"].concat();
    assert!(dates_the_work(&format!("as {word} 12 found"), &word));
    assert!(dates_the_work(
        &format!("{}S 3 and 4", word.to_uppercase()),
        &word
    ));
    assert!(!dates_the_work(&format!("{word}_id 7"), &word));
    assert!(!dates_the_work(&format!("the {word} id"), &word));
    let files = tracked_files();
    assert!(files.len() > 50, "only {} files found", files.len());
    let mut found = Vec::new();
    for file in files {
        let Ok(bytes) = std::fs::read(&file) else {
            continue; // listed but absent (deleted in the work tree)
        };
        for (number, line) in String::from_utf8_lossy(&bytes).lines().enumerate() {
            if dates_the_work(line, &word) {
                found.push(format!("{}:{}: {line}", file.display(), number + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "say what the project does and why, measured how, not when: \n{}",
        found.join("\n")
    );
}
