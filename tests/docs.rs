//! The documents a newcomer reads agree with the project: the wire contract
//! in `docs/` is the shared spec's, the licence file is the one Cargo.toml
//! names, and every replay-port example keeps the bases `--dp-size` apart.

use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path))
        .unwrap_or_else(|error| panic!("{path}: {error}"))
}

#[test]
fn docs_contract_is_a_copy_of_the_shared_spec() {
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/spec/contract.md");
    // Only where the shared spec is checked out next to the repository.
    let Ok(spec) = std::fs::read_to_string(&shared) else {
        eprintln!("SKIPPED: {} not found", shared.display());
        return;
    };
    assert!(
        read("docs/contract.md") == spec,
        "docs/contract.md differs from ../shared/spec/contract.md: copy it again"
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
        ("README.md", read("README.md")),
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
        for port in publishers {
            assert_eq!(port, 5557, "{name}: publisher base");
        }
        for port in replays {
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

/// The README's `kvgate serve` options table, made from clap's model of the
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

#[test]
fn the_readme_options_table_is_the_one_the_flags_make() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = read("README.md");
    let begin = readme
        .find(OPTIONS_BEGIN)
        .expect("README.md marks its options table")
        + OPTIONS_BEGIN.len();
    let end = begin
        + readme[begin..]
            .find(OPTIONS_END)
            .expect("README.md marks the end of its options table");
    let table = options_table();
    if readme[begin..end] == table {
        return;
    }
    if std::env::var_os("KVGATE_BLESS").is_some() {
        let updated = format!("{}{table}{}", &readme[..begin], &readme[end..]);
        std::fs::write(&path, updated).unwrap();
        eprintln!("README.md: options table rewritten from the flags");
        return;
    }
    panic!(
        "README.md's options table differs from the flags (kvgate serve --help); \
         regenerate it with `KVGATE_BLESS=1 cargo test --test docs`:\n{table}"
    );
}

/// A figure as the README writes it in a table: `512`, `1 MiB`, `1000 ms`,
/// `10M`.
fn amount(cell: &str) -> Option<u64> {
    let cell = cell.trim().trim_end_matches(" ms").trim_end_matches(" s");
    kvgate::cli_values::parse_byte_size(&cell.replace(' ', "")).ok()
}

#[test]
fn every_default_and_range_the_readme_gives_a_flag_elsewhere_is_the_flags_own() {
    use clap::CommandFactory;
    let cli = kvgate::cli::Cli::command();
    let serve = cli.find_subcommand("serve").expect("kvgate serve").clone();
    let readme = read("README.md");
    let generated = readme.find(OPTIONS_BEGIN).unwrap()..readme.find(OPTIONS_END).unwrap();
    let mut checked = 0;
    let mut offset = 0;
    for line in readme.split_inclusive('\n') {
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
                let (low, high) = numeric_range(&serve, arg, default.unwrap());
                assert_eq!(
                    (amount(bound), high),
                    (Some(low), None),
                    "--{long}: README says {cell}: {line}"
                );
            } else if let Some((low, high)) = cell.split_once('–') {
                let (lowest, highest) = numeric_range(&serve, arg, default.unwrap());
                assert_eq!(
                    (amount(low), amount(high)),
                    (Some(lowest), highest),
                    "--{long}: README says {cell}: {line}"
                );
            } else if let Some(figure) = amount(cell).filter(|_| !default_seen) {
                assert_eq!(Some(figure), default, "--{long}'s default: {line}");
                default_seen = true;
            } else {
                break;
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "found only {checked} figures to check");
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
