use std::path::{Path, PathBuf};

use bytes::Bytes;

use super::*;

/// A scratch directory under the system's temp dir, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "record-unit-{name}-{}-{}",
            std::process::id(),
            crate::clock::unix_micros_now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("stream.kvrec")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn header() -> Header {
    Header {
        kvgate_version: "test".into(),
        source: "127.0.0.1:1".into(),
        service: "kvgate.v1.KvGate".into(),
        started_unix_ms: 1,
        dp_size: 2,
        part: 0,
    }
}

const LIMITS: WriterLimits = WriterLimits {
    rotate_bytes: 1 << 30,
    frame_bytes: 64 << 10,
};

/// A part every ten batches or so.
const ROTATING: WriterLimits = WriterLimits {
    rotate_bytes: 200,
    ..LIMITS
};

/// Writes `batches` batches of distinct bytes (a frame every 10) and
/// returns them.
fn write(path: &Path, batches: u64, limits: WriterLimits, finish: bool) -> Vec<Bytes> {
    let mut writer = Writer::create(path, header(), limits).unwrap();
    let mut written = Vec::new();
    for n in 0..batches {
        let bytes = Bytes::from(format!("batch {n} {}", "x".repeat((n % 50) as usize)));
        writer.batch(1_000 + n, &bytes).unwrap();
        written.push(bytes);
        if n % 10 == 9 {
            writer.flush().unwrap();
        }
    }
    if finish {
        writer.finish().unwrap();
    } else {
        writer.flush().unwrap();
    }
    written
}

fn batches(recording: &mut Recording) -> Vec<Bytes> {
    recording
        .by_ref()
        .map(|record| match record.entry {
            Entry::Batch(bytes) => bytes,
            Entry::Resync(reason) => panic!("unexpected resync {reason}"),
        })
        .collect()
}

#[test]
fn a_closed_recording_reads_back_every_batch_and_marker_in_order() {
    let scratch = Scratch::new("roundtrip");
    let path = scratch.file();
    let mut writer = Writer::create(&path, header(), LIMITS).unwrap();
    writer.batch(5, b"one").unwrap();
    writer.resync(6, "OUT_OF_RANGE: too old").unwrap();
    writer.batch(7, b"two").unwrap();
    writer.finish().unwrap();
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(recording.header().dp_size, 2);
    let records: Vec<Record> = recording.by_ref().collect();
    assert_eq!(
        records,
        vec![
            Record {
                received_unix_micros: 5,
                entry: Entry::Batch(Bytes::from_static(b"one"))
            },
            Record {
                received_unix_micros: 6,
                entry: Entry::Resync("OUT_OF_RANGE: too old".into())
            },
            Record {
                received_unix_micros: 7,
                entry: Entry::Batch(Bytes::from_static(b"two"))
            },
        ]
    );
    assert_eq!(recording.ending(), Some(&Ending::Closed));
}

#[test]
fn a_recording_rotates_into_numbered_parts_that_read_back_as_one() {
    let scratch = Scratch::new("rotate");
    let path = scratch.file();
    let written = write(&path, 100, ROTATING, true);
    assert!(part_path(&path, 3).exists(), "several parts");
    assert_eq!(
        part_path(&path, 2).file_name().unwrap(),
        "stream.kvrec.2",
        "FILE.n"
    );
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording), written);
    assert_eq!(recording.ending(), Some(&Ending::Closed));
    let error = Writer::create(&path, header(), LIMITS).err().unwrap();
    assert!(error.to_string().contains("exists"), "{error:#}");
}

#[test]
fn a_missing_part_cuts_the_reading_naming_it() {
    let scratch = Scratch::new("missing-part");
    let path = scratch.file();
    write(&path, 100, ROTATING, true);
    std::fs::remove_file(part_path(&path, 2)).unwrap();
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording).len(), 20, "parts 0 and 1");
    let ending = recording.ending().unwrap().to_string();
    assert!(
        ending.contains("stream.kvrec.2, which is missing"),
        "{ending}"
    );
}

#[test]
fn a_torn_tail_is_cut_at_the_last_whole_frame_naming_file_and_offset() {
    let scratch = Scratch::new("torn");
    let path = scratch.file();
    let written = write(&path, 35, LIMITS, false);
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 3]).unwrap();
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording), written[..30]);
    match recording.ending().unwrap() {
        Ending::Cut {
            path: named, what, ..
        } => {
            assert_eq!(named, &path.display().to_string());
            assert!(what.contains("torn tail"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    let shown = recording.ending().unwrap().to_string();
    assert!(shown.contains("at offset"), "{shown}");
}

#[test]
fn an_unclosed_recording_reads_back_whole_and_says_so() {
    let scratch = Scratch::new("unclosed");
    let path = scratch.file();
    let written = write(&path, 25, LIMITS, false);
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording), written);
    assert!(matches!(recording.ending(), Some(Ending::Unclosed { .. })));
}

#[test]
fn every_flipped_bit_after_the_header_cuts_the_reading_at_an_intact_record_and_never_panics() {
    let scratch = Scratch::new("flips");
    let path = scratch.file();
    let written = write(&path, 30, LIMITS, true);
    let full = std::fs::read(&path).unwrap();
    let header_end = full.len() - frames_len(&full);
    for at in header_end..full.len() {
        for bit in [0, 5] {
            let mut damaged = full.clone();
            damaged[at] ^= 1 << bit;
            std::fs::write(&path, &damaged).unwrap();
            let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
            let read = batches(&mut recording);
            assert_eq!(read, written[..read.len()], "a prefix (byte {at})");
            assert!(
                matches!(recording.ending(), Some(Ending::Cut { .. })),
                "byte {at}: {:?}",
                recording.ending()
            );
        }
    }
}

/// Bytes after part 0's header.
fn frames_len(file: &[u8]) -> usize {
    let json_len = u32::from_le_bytes(file[10..14].try_into().unwrap()) as usize;
    file.len() - (18 + json_len)
}

#[test]
fn a_huge_frame_length_is_refused_before_anything_is_allocated() {
    let scratch = Scratch::new("huge");
    let path = scratch.file();
    write(&path, 10, LIMITS, false);
    let mut file = std::fs::read(&path).unwrap();
    let first_frame = file.len() - frames_len(&file);
    for length in [u32::MAX, MAX_FRAME_BYTES, 0] {
        file[first_frame..first_frame + 4].copy_from_slice(&length.to_le_bytes());
        std::fs::write(&path, &file).unwrap();
        let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
        assert!(batches(&mut recording).is_empty());
        let ending = recording.ending().unwrap().to_string();
        assert!(
            ending.contains(&format!("at offset {first_frame}")),
            "{ending}"
        );
    }
}

#[test]
fn a_foreign_file_and_a_future_version_are_refused_naming_the_file() {
    let scratch = Scratch::new("foreign");
    let path = scratch.file();
    std::fs::write(&path, b"{\"timestamp\": 0, \"hash_ids\": [1]}\n").unwrap();
    let error = Recording::open(std::slice::from_ref(&path)).err().unwrap();
    assert!(matches!(error, OpenError::Foreign { .. }), "{error}");
    assert!(error.to_string().starts_with(&path.display().to_string()));
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        Recording::open(std::slice::from_ref(&path)),
        Err(OpenError::Foreign { .. })
    ));

    std::fs::remove_file(&path).unwrap();
    write(&path, 3, LIMITS, true);
    let mut file = std::fs::read(&path).unwrap();
    file[8..10].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    std::fs::write(&path, &file).unwrap();
    let error = Recording::open(std::slice::from_ref(&path)).err().unwrap();
    assert!(
        error.to_string().contains("format version 2 is newer"),
        "{error}"
    );

    file[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    file[10..14].copy_from_slice(&u32::MAX.to_le_bytes());
    std::fs::write(&path, &file).unwrap();
    let error = Recording::open(std::slice::from_ref(&path)).err().unwrap();
    assert!(
        error
            .to_string()
            .contains("damaged recording header at offset 10"),
        "{error}"
    );
}

/// Rewrites the header of the part at `path` to claim part number `part`,
/// with a checksum that matches: a crafted header, not a damaged one.
fn claim_part(path: &Path, part: u32) {
    let file = std::fs::read(path).unwrap();
    let json_len = u32::from_le_bytes(file[10..14].try_into().unwrap()) as usize;
    let mut header: Header = serde_json::from_slice(&file[14..14 + json_len]).unwrap();
    header.part = part;
    let json = serde_json::to_vec(&header).unwrap();
    let mut crafted = file[..10].to_vec();
    crafted.extend_from_slice(&u32::try_from(json.len()).unwrap().to_le_bytes());
    crafted.extend_from_slice(&json);
    crafted.extend_from_slice(&crc32c::crc32c(&json).to_le_bytes());
    crafted.extend_from_slice(&file[18 + json_len..]);
    std::fs::write(path, crafted).unwrap();
}

#[test]
fn a_part_numbered_last_that_says_the_recording_goes_on_cuts_the_reading_and_never_panics() {
    let scratch = Scratch::new("last-part-number");
    let path = scratch.file();
    write(&path, 100, ROTATING, true);
    claim_part(&path, u32::MAX);
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording).len(), 10, "part 0 only");
    let ending = recording.ending().unwrap().to_string();
    assert!(ending.contains("past the last part number"), "{ending}");

    claim_part(&path, 0);
    claim_part(&part_path(&path, 1), u32::MAX);
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    assert_eq!(batches(&mut recording).len(), 10, "part 0 only");
    let ending = recording.ending().unwrap().to_string();
    assert!(
        ending.contains(&format!("part {} where part 1 was expected", u32::MAX)),
        "{ending}"
    );
}

#[test]
fn no_file_at_all_is_refused_as_such() {
    let error = Recording::open(&[]).err().unwrap();
    assert!(matches!(error, OpenError::NoFile), "{error}");
    assert_eq!(error.to_string(), "no recording file given");
}

#[test]
fn a_batch_read_back_holds_its_own_bytes_not_its_frame() {
    let scratch = Scratch::new("own-bytes");
    let path = scratch.file();
    // All ten in one frame: slices of it would share its buffer.
    let written = write(&path, 10, LIMITS, true);
    let mut recording = Recording::open(std::slice::from_ref(&path)).unwrap();
    let read = batches(&mut recording);
    assert_eq!(read, written);
    assert!(read.iter().all(Bytes::is_unique));
}
