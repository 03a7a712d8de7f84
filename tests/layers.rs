//! The client-side commands (`src/tools/`: `kvgate tail`, `status`,
//! completions, the man page) are one layer above the gateway library: the
//! command line (`src/cli.rs`) names their arguments and `src/main.rs` runs
//! them, and no gateway module imports them; they, in turn, import no part of
//! the command line or the gateway's wiring. docs/architecture.md states the
//! rule; this scans the source for a path that breaks it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

/// Every (file relative to src/, line number, line) of the library's code,
/// comments left out.
fn code_lines() -> Vec<(String, usize, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut lines = Vec::new();
    for file in files {
        let name = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        for (number, line) in std::fs::read_to_string(&file).unwrap().lines().enumerate() {
            if !line.trim_start().starts_with("//") {
                lines.push((name.clone(), number + 1, line.to_owned()));
            }
        }
    }
    assert!(lines.len() > 1000, "found too little source under src/");
    lines
}

/// Whether `line` names the module `path` (`crate::cli`, not
/// `crate::client`; `tools::tail`, not `devtools::`).
fn names_module(line: &str, path: &str) -> bool {
    let identifier = |c: char| c.is_ascii_alphanumeric() || c == '_';
    line.match_indices(path).any(|(at, _)| {
        !line[..at].ends_with(identifier) && !line[at + path.len()..].starts_with(identifier)
    })
}

#[test]
fn no_gateway_module_imports_the_client_side_commands() {
    // lib.rs declares the module; cli.rs names the commands' arguments.
    let allowed =
        |file: &str| file.starts_with("tools/") || ["cli.rs", "main.rs", "lib.rs"].contains(&file);
    let offending: Vec<String> = code_lines()
        .into_iter()
        .filter(|(file, _, line)| !allowed(file) && names_module(line, "tools"))
        .map(|(file, number, line)| format!("src/{file}:{number}: {}", line.trim()))
        .collect();
    assert!(
        offending.is_empty(),
        "gateway modules import src/tools/:\n{}",
        offending.join("\n")
    );
}

#[test]
fn the_client_side_commands_import_neither_the_command_line_nor_the_gateways_wiring() {
    let offending: Vec<String> = code_lines()
        .into_iter()
        .filter(|(file, _, line)| {
            file.starts_with("tools/")
                && ["crate::cli", "crate::app", "crate::usage", "kvgate::cli"]
                    .iter()
                    .any(|path| names_module(line, path))
        })
        .map(|(file, number, line)| format!("src/{file}:{number}: {}", line.trim()))
        .collect();
    assert!(
        offending.is_empty(),
        "src/tools/ imports the layer above it:\n{}",
        offending.join("\n")
    );
}

#[test]
fn no_two_client_side_commands_import_each_other_round_a_circle() {
    let lines = code_lines();
    let command = |file: &str| {
        file.strip_prefix("tools/")
            .and_then(|name| name.strip_suffix(".rs"))
            .filter(|name| *name != "mod")
            .map(str::to_owned)
    };
    let commands: BTreeSet<String> = lines
        .iter()
        .filter_map(|(file, ..)| command(file))
        .collect();
    assert!(commands.len() >= 3, "found the commands {commands:?}");
    // Who names whom: `super::tail`, `tools::tail`, `use super::{tail, ...}`.
    let mut imports: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, _, line) in &lines {
        let Some(importer) = command(file) else {
            continue;
        };
        for imported in &commands {
            let named = ["super::", "tools::"].iter().any(|prefix| {
                names_module(line, &format!("{prefix}{imported}"))
                    || (line.contains(&format!("{prefix}{{")) && names_module(line, imported))
            });
            if named && imported != &importer {
                imports
                    .entry(importer.clone())
                    .or_default()
                    .insert(imported.clone());
            }
        }
    }
    // A circle is a path back to where it started.
    for start in &commands {
        let mut seen = BTreeSet::new();
        let mut frontier: Vec<Vec<String>> = vec![vec![start.clone()]];
        while let Some(walk) = frontier.pop() {
            let last = walk.last().unwrap();
            for next in imports.get(last).into_iter().flatten() {
                let mut longer = walk.clone();
                longer.push(next.clone());
                assert!(
                    next != start,
                    "src/tools/ modules import each other round a circle: {}",
                    longer.join(" -> ")
                );
                if seen.insert(next.clone()) {
                    frontier.push(longer);
                }
            }
        }
    }
}

#[test]
fn the_index_imports_only_its_sources_the_converter_and_the_foundation() {
    let downstream = [
        "crate::drain",
        "crate::hub",
        "crate::state",
        "crate::store",
        "crate::server",
        "crate::app",
        "crate::cli",
    ];
    let offending: Vec<String> = code_lines()
        .into_iter()
        .filter(|(file, _, line)| {
            file.starts_with("index/") && downstream.iter().any(|path| names_module(line, path))
        })
        .map(|(file, number, line)| format!("src/{file}:{number}: {}", line.trim()))
        .collect();
    assert!(
        offending.is_empty(),
        "src/index/ imports a stage after it or the wiring:\n{}",
        offending.join("\n")
    );
}

#[test]
fn no_stage_before_the_index_imports_it() {
    let upstream = [
        "source/", "convert/", "drain/", "hub/", "state/", "store/", "wire/", "load/",
    ];
    let offending: Vec<String> = code_lines()
        .into_iter()
        .filter(|(file, _, line)| {
            upstream.iter().any(|stage| file.starts_with(stage))
                && names_module(line, "crate::index")
        })
        .map(|(file, number, line)| format!("src/{file}:{number}: {}", line.trim()))
        .collect();
    assert!(
        offending.is_empty(),
        "a stage before the index imports it:\n{}",
        offending.join("\n")
    );
}
