//! A lenient, allocation-free msgpack reader over a byte slice.
//!
//! Invariants: no read goes past the slice (every failure is an [`Error`],
//! never a panic); nothing is allocated, so a header claiming 2^32 elements
//! costs nothing until the elements are actually read (the one buffer
//! filled, the caller's token buffer in [`Reader::u32_array`], grows to at
//! most one `u32` per byte left, and only for an array that claims no
//! more elements than that); and skipping a value
//! keeps only a count of values still owed, not a stack, so it runs in
//! constant memory whatever the nesting depth and fails as soon as the count
//! exceeds the bytes left (every value takes at least one byte).

use rmp::Marker;

/// Why bytes are not (complete) msgpack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Error {
    /// The input ends inside a value, or a header claims more than is left.
    Truncated,
    /// The one byte msgpack never uses (`0xc1`).
    ReservedMarker,
}

impl Error {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Error::Truncated => "truncated",
            Error::ReservedMarker => "reserved marker 0xc1",
        }
    }
}

/// One msgpack item. Containers are only their header: their elements follow
/// in the reader (a map's as key, value, key, value...).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Item<'a> {
    Nil,
    Bool(bool),
    /// Any integer encoding; `i128` holds both `u64` and `i64` exactly.
    Int(i128),
    Float(f64),
    /// Raw bytes: UTF-8 is only checked where a string is kept.
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    /// An extension value; kvgate has no use for its type or data.
    Ext,
}

#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// How [`Reader::u32_array`] reads a cell from its marker and the 4 bytes
/// after it, held as one `u64` (marker above them): shift it right by
/// `shift`, keep `mask`.
#[derive(Clone, Copy)]
struct U32Cell {
    shift: u8,
    mask: u64,
    /// Not an unsigned int that fits a `u32`: the fast path gives up.
    foreign: bool,
}

/// A cell of an unsigned int that fits a `u32`.
const fn token_cell(shift: u8, mask: u64) -> U32Cell {
    U32Cell {
        shift,
        mask,
        foreign: false,
    }
}

const U32_CELLS: [U32Cell; 256] = {
    let foreign = U32Cell {
        shift: 0,
        mask: 0,
        foreign: true,
    };
    let mut cells = [foreign; 256];
    let mut marker = 0;
    while marker < 0x80 {
        cells[marker] = token_cell(32, 0x7f);
        marker += 1;
    }
    cells[0xcc] = token_cell(24, 0xff);
    cells[0xcd] = token_cell(16, 0xffff);
    cells[0xce] = token_cell(0, 0xffff_ffff);
    cells
};

/// The bytes of a cell led by `marker`, if it is an unsigned int that fits
/// a `u32` (1 for a fixint; 2, 3, 5 for `0xcc`, `0xcd`, `0xce`); 2 to 9
/// for any other. Worked out rather than looked up: the next cell's place
/// waits on it, and a table read is a load more in that chain (without
/// it, converting the sim's 64-block stores went from 8.4-8.5 to 10.4 M
/// blocks/s).
fn cell_width(marker: u8) -> usize {
    1 + (usize::from(marker >> 7) << (marker & 3))
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// How many of `claimed` values of at least `min_bytes` each can really
    /// follow: what a buffer for them may reserve before they are read.
    pub(crate) fn room_for(&self, claimed: u32, min_bytes: usize) -> usize {
        (claimed as usize).min(self.remaining() / min_bytes)
    }

    #[inline(always)]
    fn take(&mut self, len: usize) -> Result<&'a [u8], Error> {
        let bytes = self
            .pos
            .checked_add(len)
            .and_then(|end| self.buf.get(self.pos..end))
            .ok_or(Error::Truncated)?;
        self.pos += len;
        Ok(bytes)
    }

    #[inline(always)]
    fn be<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let bytes = self.take(N)?;
        bytes.first_chunk::<N>().copied().ok_or(Error::Truncated)
    }

    fn len8(&mut self) -> Result<usize, Error> {
        Ok(u8::from_be_bytes(self.be()?).into())
    }

    fn len16(&mut self) -> Result<usize, Error> {
        Ok(u16::from_be_bytes(self.be()?).into())
    }

    fn len32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.be()?))
    }

    fn ext(&mut self, data_len: usize) -> Result<Item<'a>, Error> {
        let _type = self.take(1)?;
        self.take(data_len)?;
        Ok(Item::Ext)
    }

    /// Reads an array of unsigned ints that each fit a `u32` (token ids, in
    /// practice always) into `out` in one tight loop. Anything else leaves
    /// the reader where it was and returns `None`, for the general path.
    pub(crate) fn u32_array(&mut self, out: &mut Vec<u32>) -> Option<()> {
        let mut probe = self.clone();
        let Ok(Item::Array(len)) = probe.item() else {
            return None;
        };
        let count = len as usize;
        if probe.room_for(len, 1) < count {
            return None;
        }
        out.clear();
        out.resize(count, 0);
        let mut rest = probe.buf.get(probe.pos..)?;
        // Token widths follow no pattern (a 150k vocabulary is half 16-bit,
        // half 32-bit), so while the widest step (9 bytes, a foreign
        // marker's) fits, each cell is read without a branch on its marker:
        // its 4 following bytes are loaded whatever it is and a table says
        // which of them it owns.
        let mut foreign = false;
        let mut read = 0;
        for slot in out.iter_mut() {
            let Some(&[marker, ref word @ .., _, _, _, _]) = rest.first_chunk::<9>() else {
                break;
            };
            let word: [u8; 4] = *word;
            let cell = U32_CELLS[usize::from(marker)];
            let wide = u64::from(marker) << 32 | u64::from(u32::from_be_bytes(word));
            *slot = ((wide >> cell.shift) & cell.mask) as u32;
            foreign |= cell.foreign;
            rest = &rest[cell_width(marker)..];
            read += 1;
        }
        if foreign {
            return None;
        }
        for slot in &mut out[read..] {
            let (value, width) = match *rest {
                [byte @ 0x00..=0x7f, ..] => (u32::from(byte), 1),
                [0xcc, byte, ..] => (u32::from(byte), 2),
                [0xcd, high, low, ..] => (u32::from(u16::from_be_bytes([high, low])), 3),
                [0xce, a, b, c, d, ..] => (u32::from_be_bytes([a, b, c, d]), 5),
                _ => return None,
            };
            *slot = value;
            rest = &rest[width..];
        }
        probe.pos = probe.buf.len() - rest.len();
        *self = probe;
        Some(())
    }

    /// Reads the next item; for a str, bin or ext this consumes its payload.
    #[inline(always)]
    pub(crate) fn item(&mut self) -> Result<Item<'a>, Error> {
        let [byte] = self.be::<1>()?;
        Ok(match Marker::from_u8(byte) {
            Marker::FixPos(v) => Item::Int(v.into()),
            Marker::FixNeg(v) => Item::Int(v.into()),
            Marker::Null => Item::Nil,
            Marker::True => Item::Bool(true),
            Marker::False => Item::Bool(false),
            Marker::U8 => Item::Int(u8::from_be_bytes(self.be()?).into()),
            Marker::U16 => Item::Int(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => Item::Int(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => Item::Int(u64::from_be_bytes(self.be()?).into()),
            Marker::I8 => Item::Int(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => Item::Int(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => Item::Int(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => Item::Int(i64::from_be_bytes(self.be()?).into()),
            Marker::F32 => Item::Float(f32::from_be_bytes(self.be()?).into()),
            Marker::F64 => Item::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(len) => Item::Str(self.take(len.into())?),
            Marker::Str8 => {
                let len = self.len8()?;
                Item::Str(self.take(len)?)
            }
            Marker::Str16 => {
                let len = self.len16()?;
                Item::Str(self.take(len)?)
            }
            Marker::Str32 => {
                let len = self.len32()?;
                Item::Str(self.take(len as usize)?)
            }
            Marker::Bin8 => {
                let len = self.len8()?;
                Item::Bin(self.take(len)?)
            }
            Marker::Bin16 => {
                let len = self.len16()?;
                Item::Bin(self.take(len)?)
            }
            Marker::Bin32 => {
                let len = self.len32()?;
                Item::Bin(self.take(len as usize)?)
            }
            Marker::FixArray(len) => Item::Array(len.into()),
            Marker::Array16 => Item::Array(self.len16()? as u32),
            Marker::Array32 => Item::Array(self.len32()?),
            Marker::FixMap(len) => Item::Map(len.into()),
            Marker::Map16 => Item::Map(self.len16()? as u32),
            Marker::Map32 => Item::Map(self.len32()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let len = self.len8()?;
                self.ext(len)?
            }
            Marker::Ext16 => {
                let len = self.len16()?;
                self.ext(len)?
            }
            Marker::Ext32 => {
                let len = self.len32()?;
                self.ext(len as usize)?
            }
            Marker::Reserved => return Err(Error::ReservedMarker),
        })
    }

    /// Skips `count` complete values.
    pub(crate) fn skip_values(&mut self, count: u64) -> Result<(), Error> {
        // Every scalar field of every event is captured by skipping it, so
        // this loop keeps its position in a local and sizes the common markers
        // itself; `item` handles the rest (a unit test checks both agree on
        // all 256 markers).
        let buf = self.buf;
        let mut pos = self.pos;
        let mut owed = count;
        while owed > 0 {
            if owed > buf.len().saturating_sub(pos) as u64 {
                return Err(Error::Truncated);
            }
            owed -= 1;
            let Some(&byte) = buf.get(pos) else {
                return Err(Error::Truncated);
            };
            let size = match byte {
                0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 1,
                0xa0..=0xbf => 1 + usize::from(byte & 0x1f),
                0x90..=0x9f => {
                    owed += u64::from(byte & 0x0f);
                    1
                }
                0x80..=0x8f => {
                    owed += 2 * u64::from(byte & 0x0f);
                    1
                }
                0xcc | 0xd0 => 2,
                0xcd | 0xd1 => 3,
                0xca | 0xce | 0xd2 => 5,
                0xcb | 0xcf | 0xd3 => 9,
                _ => {
                    self.pos = pos;
                    match self.item()? {
                        Item::Array(len) => owed += u64::from(len),
                        Item::Map(len) => owed += 2 * u64::from(len),
                        _ => {}
                    }
                    self.pos - pos
                }
            };
            pos += size;
            if pos > buf.len() {
                return Err(Error::Truncated);
            }
        }
        self.pos = pos;
        Ok(())
    }

    /// Skips the rest of a container whose header `item` was just read.
    pub(crate) fn skip_contents(&mut self, item: Item<'a>) -> Result<(), Error> {
        match item {
            Item::Array(len) => self.skip_values(len.into()),
            Item::Map(len) => self.skip_values(2 * u64::from(len)),
            _ => Ok(()),
        }
    }

    /// Reads one complete value but returns only its head: a container's
    /// elements are skipped.
    pub(crate) fn value_head(&mut self) -> Result<Item<'a>, Error> {
        let head = self.item()?;
        self.skip_contents(head)?;
        Ok(head)
    }

    /// Skips one complete value and returns its encoded bytes.
    pub(crate) fn value_bytes(&mut self) -> Result<&'a [u8], Error> {
        let start = self.pos;
        self.skip_values(1)?;
        Ok(&self.buf[start..self.pos])
    }

    /// Where the next read starts, in the whole input.
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// The input from `start` (an earlier [`Reader::position`]) up to
    /// where the next read starts.
    pub(crate) fn read_since(&self, start: usize) -> &'a [u8] {
        &self.buf[start..self.pos]
    }

    /// Consumes `bytes` if the unread input starts with them; otherwise
    /// reads nothing.
    pub(crate) fn eat(&mut self, bytes: &[u8]) -> bool {
        let matches = self.buf[self.pos..]
            .get(..bytes.len())
            .is_some_and(|start| same_bytes(start, bytes));
        if matches {
            self.pos += bytes.len();
        }
        matches
    }

    /// Goes back to `position`, an earlier [`Reader::position`].
    pub(crate) fn rewind(&mut self, position: usize) {
        debug_assert!(position <= self.pos, "only back");
        self.pos = position;
    }
}

/// Whether `a` and `b`, of one length, hold the same bytes: from 8 bytes
/// on, 8 at a time, the last 8 overlapping those before, inlined. Not
/// `==` (left to the shorter), which calls `memcmp`: a call per comparison
/// of a removal's bytes around its hashes with the memo's (tens of bytes,
/// lengths known only at run time) cost about 14 ns each in the evicting
/// ingest's profile.
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    debug_assert_eq!(a.len(), b.len());
    let len = a.len();
    if len < 8 {
        return a == b;
    }
    let word = |bytes: &[u8], at: usize| {
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
    };
    let mut at = 0;
    while at + 8 < len {
        if word(a, at) != word(b, at) {
            return false;
        }
        at += 8;
    }
    word(a, len - 8) == word(b, len - 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eat_consumes_exactly_the_bytes_it_is_given_and_nothing_on_any_difference() {
        let input: Vec<u8> = (1..=48).collect();
        for len in 0..=40 {
            let start = &input[..len];
            let mut r = Reader::new(&input);
            assert!(r.eat(start), "{len} bytes");
            assert_eq!(r.position(), len);
            for differing in 0..len {
                let mut other = start.to_vec();
                other[differing] ^= 0x80;
                let mut r = Reader::new(&input);
                assert!(!r.eat(&other), "{len} bytes, byte {differing} differs");
                assert_eq!(r.position(), 0);
            }
            let mut r = Reader::new(&input[..len.saturating_sub(1)]);
            assert_eq!(r.eat(start), len == 0, "input shorter than {len} bytes");
            assert_eq!(r.position(), 0);
        }
    }

    fn items(bytes: &[u8]) -> Result<Vec<Item<'_>>, Error> {
        let mut r = Reader::new(bytes);
        let mut out = Vec::new();
        while r.remaining() > 0 {
            out.push(r.item()?);
        }
        Ok(out)
    }

    #[test]
    fn integers_of_every_width_read_exactly() {
        let bytes = [
            0x05, 0xe0, 0xcc, 0xff, 0xcd, 0x01, 0x00, 0xce, 0xff, 0xff, 0xff, 0xff, 0xcf, 0xff,
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xd0, 0x80, 0xd1, 0x80, 0x00, 0xd2, 0x80,
            0x00, 0x00, 0x00, 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0,
        ];
        let expected = [
            5,
            -32,
            255,
            256,
            u32::MAX.into(),
            u64::MAX.into(),
            i8::MIN.into(),
            i16::MIN.into(),
            i32::MIN.into(),
            i64::MIN.into(),
        ]
        .map(Item::Int);
        assert_eq!(items(&bytes).unwrap(), expected);
    }

    #[test]
    fn floats_strings_bins_and_headers_read() {
        let mut bytes = vec![0xca];
        bytes.extend(1.5f32.to_be_bytes());
        bytes.push(0xcb);
        bytes.extend(2.25f64.to_be_bytes());
        bytes.extend([
            0xa2, b'h', b'i', 0xd9, 1, b'x', 0xc4, 2, 7, 8, 0x92, 0xde, 0, 3,
        ]);
        bytes.extend([0xc0, 0xc2, 0xc3, 0xd4, 1, 9, 0xc7, 2, 1, 0xaa, 0xbb]);
        assert_eq!(
            items(&bytes).unwrap(),
            [
                Item::Float(1.5),
                Item::Float(2.25),
                Item::Str(b"hi"),
                Item::Str(b"x"),
                Item::Bin(&[7, 8]),
                Item::Array(2),
                Item::Map(3),
                Item::Nil,
                Item::Bool(false),
                Item::Bool(true),
                Item::Ext,
                Item::Ext,
            ]
        );
    }

    #[test]
    fn every_truncation_of_a_value_is_an_error_not_a_panic() {
        let bytes = [
            0x93, 0xcf, 1, 2, 3, 4, 5, 6, 7, 8, 0xa3, b'a', b'b', b'c', 0x81, 1, 2,
        ];
        Reader::new(&bytes).value_bytes().unwrap();
        for cut in 0..bytes.len() {
            assert_eq!(
                Reader::new(&bytes[..cut]).value_bytes(),
                Err(Error::Truncated),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn skipping_sizes_every_marker_exactly_as_reading_it_does() {
        for marker in 0..=u8::MAX {
            for fill in [0x00, 0x01] {
                let mut bytes = vec![marker];
                bytes.resize(1 + 600, fill);
                let mut skipped = Reader::new(&bytes);
                let skip = skipped.skip_values(1).map(|()| skipped.remaining());
                let mut read = Reader::new(&bytes);
                let head = read.item().and_then(|head| read.skip_contents(head));
                assert_eq!(
                    skip,
                    head.map(|()| read.remaining()),
                    "marker {marker:#04x}, fill {fill}"
                );
            }
        }
    }

    #[test]
    fn the_reserved_byte_is_rejected() {
        assert_eq!(Reader::new(&[0xc1]).item(), Err(Error::ReservedMarker));
    }

    #[test]
    fn a_header_claiming_2_pow_32_elements_in_a_short_payload_fails_at_once() {
        let bytes = [0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02];
        assert_eq!(Reader::new(&bytes).value_bytes(), Err(Error::Truncated));
        let map = [0xdf, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02];
        assert_eq!(Reader::new(&map).value_bytes(), Err(Error::Truncated));
        let str32 = [0xdb, 0xff, 0xff, 0xff, 0xff, b'a'];
        assert_eq!(Reader::new(&str32).item(), Err(Error::Truncated));
    }

    #[test]
    fn skipping_a_million_nested_arrays_needs_no_stack() {
        let depth = 1_000_000;
        let mut bytes = vec![0x91; depth];
        bytes.push(0xc0);
        bytes.push(0x07);
        let mut r = Reader::new(&bytes);
        assert_eq!(r.value_bytes().unwrap().len(), depth + 1);
        assert_eq!(r.item(), Ok(Item::Int(7)));
    }

    #[test]
    fn value_bytes_spans_exactly_one_value() {
        let bytes = [0x82, 0xa1, b'k', 0x92, 1, 2, 0x01, 0xc0, 0xc0, 0x2a];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.value_bytes().unwrap(), &bytes[..8]);
        assert_eq!(r.value_bytes().unwrap(), &[0xc0]);
        assert_eq!(r.item(), Ok(Item::Int(42)));
    }
}

#[cfg(test)]
mod u32_array_tests {
    use super::*;

    fn encoded(values: &[u64]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_array_len(&mut out, values.len() as u32).unwrap();
        for &value in values {
            rmp::encode::write_uint(&mut out, value).unwrap();
        }
        out
    }

    #[test]
    fn a_plain_token_array_is_read_whole_at_any_int_width() {
        let values = [0, 127, 128, 255, 256, 65_535, 65_536, u64::from(u32::MAX)];
        let bytes = encoded(&values);
        let mut reader = Reader::new(&bytes);
        let mut out = vec![9];
        assert_eq!(reader.u32_array(&mut out), Some(()));
        assert_eq!(
            out.iter().map(|&v| u64::from(v)).collect::<Vec<_>>(),
            values
        );
        assert_eq!(reader.remaining(), 0);
    }

    #[test]
    fn a_long_token_array_is_read_whole_up_to_the_bytes_after_it() {
        let values: Vec<u64> = (0..1000u64)
            .map(|i| [i % 128, 200, 40_000, 3_000_000, u64::from(u32::MAX)][(i % 5) as usize])
            .collect();
        let mut bytes = encoded(&values);
        bytes.extend_from_slice(&[0xc0, 0xce, 0xff, 0xff]);
        let mut reader = Reader::new(&bytes);
        let mut out = Vec::new();
        assert_eq!(reader.u32_array(&mut out), Some(()));
        assert!(out.iter().map(|&v| u64::from(v)).eq(values.iter().copied()));
        assert_eq!(reader.remaining(), 4, "the next values are left unread");
    }

    #[test]
    fn a_foreign_cell_anywhere_in_a_long_array_sends_it_to_the_general_path() {
        let plain: Vec<u64> = (0..100).map(|i| i * 1_000).collect();
        for at in [0, 50, 98, 99] {
            for foreign in [0xcf, 0xd0, 0xff, 0xc0, 0xa1] {
                let mut bytes = encoded(&plain);
                let header = 3;
                let cell = header
                    + plain[..at]
                        .iter()
                        .map(|&value| encoded(&[value]).len() - 1)
                        .sum::<usize>();
                bytes[cell] = foreign;
                let mut reader = Reader::new(&bytes);
                assert_eq!(
                    reader.u32_array(&mut Vec::new()),
                    None,
                    "{foreign:#x} at {at}"
                );
                assert_eq!(reader.remaining(), bytes.len());
            }
        }
    }

    #[test]
    fn a_foreign_cell_in_the_last_bytes_of_a_long_array_sends_it_to_the_general_path() {
        let mut values = vec![1_000u64; 100];
        values.extend([1, 2, 3, 4]);
        let mut bytes = encoded(&values);
        // The last 4 one-byte cells are read by the tail loop: 1, 2, then
        // an `int8` (valid msgpack, not a token cell) holding the last byte.
        let at = bytes.len() - 2;
        bytes[at] = 0xd0;
        let mut reader = Reader::new(&bytes);
        assert_eq!(reader.u32_array(&mut Vec::new()), None);
        assert_eq!(reader.remaining(), bytes.len());
    }

    #[test]
    fn anything_else_leaves_the_reader_for_the_general_path() {
        for bytes in [
            encoded(&[1, 2, u64::from(u32::MAX) + 1]),
            [0x92, 0x01, 0xff].to_vec(),
            [0x92, 0x01, 0x92, 0x01, 0x02].to_vec(),
            [0x93, 0x01].to_vec(),
            [0xc0].to_vec(),
        ] {
            let mut reader = Reader::new(&bytes);
            assert_eq!(reader.u32_array(&mut Vec::new()), None, "{bytes:?}");
            assert_eq!(reader.remaining(), bytes.len());
        }
    }
}
