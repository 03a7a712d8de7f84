//! The README's fleet section works as written: its commands, run with
//! ephemeral ports in place of the ones it names (and nothing else
//! changed), give two index replicas that each follow both sidecars and
//! answer its queries.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;

use common::index::{get, request};
use common::{DEADLINE, Gateway, IndexProcess, poll_until};
use serde_json::Value;

/// The first ```sh block after the sentence that introduces the fleet.
fn fleet_block() -> String {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let section = readme
        .split_once("A fleet of two engines")
        .expect("the README shows a fleet")
        .1;
    let block = section.split_once("```sh\n").expect("a shell block").1;
    block
        .split_once("```")
        .expect("the block ends")
        .0
        .to_owned()
}

/// The block's commands, continuation lines joined, a trailing `&` dropped,
/// each split into words as the shell does for these quotes.
fn commands(block: &str) -> Vec<Vec<String>> {
    block
        .replace("\\\n", " ")
        .lines()
        .map(|line| line.trim().trim_end_matches('&').trim())
        .filter(|line| !line.is_empty())
        .map(words)
        .collect()
}

fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut in_word = false;
    for character in line.chars() {
        match (quote, character) {
            (Some(open), close) if open == close => quote = None,
            (Some(_), inside) => word.push(inside),
            (None, '"' | '\'') => {
                quote = Some(character);
                in_word = true;
            }
            (None, space) if space.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, other) => {
                word.push(other);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The value after `flag`, and the words without the two.
fn take_flag(words: &[String], flag: &str) -> (String, Vec<String>) {
    let at = words
        .iter()
        .position(|word| word == flag)
        .unwrap_or_else(|| panic!("{flag} in {words:?}"));
    let mut rest = words.to_vec();
    let value = rest.remove(at + 1);
    rest.remove(at);
    (value, rest)
}

/// `text` with every address the README named replaced by where that
/// process really listens.
fn translated(text: &str, addresses: &HashMap<String, SocketAddr>) -> String {
    addresses
        .iter()
        .fold(text.to_owned(), |text, (named, real)| {
            text.replace(named, &real.to_string())
        })
}

#[tokio::test(flavor = "multi_thread")]
async fn the_fleet_started_as_the_readme_says_has_both_replicas_follow_both_sidecars_and_answer() {
    let commands = commands(&fleet_block());
    let mut addresses: HashMap<String, SocketAddr> = HashMap::new();
    let mut sidecars = Vec::new();
    let mut indexes = Vec::new();
    let mut curls = Vec::new();
    for command in &commands {
        match command.first().map(String::as_str) {
            Some("kvgate") if command[1] == "serve" => {
                let (named, rest) = take_flag(&command[2..], "--listen");
                let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
                let sidecar = Gateway::start(&rest);
                addresses.insert(named, sidecar.address);
                sidecars.push(sidecar);
            }
            Some("kvgate") if command[1] == "index" => {
                let (named, rest) = take_flag(&command[2..], "--listen");
                let rest: Vec<String> = rest
                    .iter()
                    .map(|word| translated(word, &addresses))
                    .collect();
                let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
                let index = IndexProcess::start(&rest);
                addresses.insert(named, index.address);
                indexes.push(index);
            }
            Some("curl") => curls.push(command.clone()),
            _ => panic!("a command the test does not know: {command:?}"),
        }
    }
    assert_eq!((sidecars.len(), indexes.len()), (2, 2), "{commands:?}");

    // Each replica follows both sidecars, on its own, and holds their blocks.
    for index in &indexes {
        let address = index.address;
        poll_until("a replica follows both sidecars", DEADLINE, || {
            let workers = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(get(address, "/workers"))
            })
            .1;
            workers.as_array().is_some_and(|workers| {
                workers.len() == 2
                    && workers
                        .iter()
                        .all(|worker| worker["kvgate"]["state"] == "connected")
            })
        })
        .await;
        poll_until("a replica holds both engines' blocks", DEADLINE, || {
            let dump = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(get(address, "/dump"))
            })
            .1;
            let events = dump["demo:default"]["events"].as_array().cloned();
            events.is_some_and(|events| {
                [1, 2]
                    .iter()
                    .all(|worker| events.iter().any(|event| event["worker_id"] == *worker))
            })
        })
        .await;
    }

    // The README's requests, as curl sends them, answer 200 with JSON.
    assert_eq!(curls.len(), 2, "{curls:?}");
    for curl in curls {
        let url = curl
            .iter()
            .find(|word| word.starts_with("127.0.0.1:"))
            .expect("a URL");
        let url = translated(url, &addresses);
        let (host, path) = url.split_once('/').expect("a path");
        let address: SocketAddr = host.parse().unwrap();
        let path = format!("/{path}");
        let (status, body) = match curl.iter().position(|word| word == "-d") {
            Some(at) => request(address, "POST", &path, curl[at + 1].as_bytes()).await,
            None => request(address, "GET", &path, b"").await,
        };
        assert_eq!(status, 200, "{curl:?}: {body}");
        let answer: Value = serde_json::from_str(&body).expect("a JSON answer");
        if path == "/query" {
            assert!(answer["scores"].is_object() && answer["instances"].is_object());
        }
    }
}
