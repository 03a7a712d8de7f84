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
    assert!(
        man.starts_with(".ie") || man.contains(".TH kvgate 1"),
        "{man}"
    );
    for section in [
        ".TH kvgate-serve 1",
        ".TH kvgate-tail 1",
        "zmq\\-replay\\-endpoint",
    ] {
        assert!(man.contains(section), "man page lacks {section}");
    }
}
