//! The body of a `/query` or `/query_by_hash` request, read in one pass.
//!
//! A query's body is almost all one array of integers (a thousand tokens is
//! ten kilobytes), and reading that array through serde took a fifth of the
//! index's CPU per query. The array is read here by hand; every other field
//! is read by serde_json.
//!
//! Invariant: the result is serde_json's, or the body is read by serde_json
//! instead. The hand-read path takes only what it is sure of: an object of
//! unescaped keys, each once, the array of plain decimal integers, each in
//! range. Anything else (an escape, a fraction, an exponent, a leading zero,
//! a sign where none belongs, a number out of range, a repeated key,
//! trailing text) sends the whole body to serde_json, so a refusal's status
//! and text are axum's `Json` extractor's, byte for byte.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

/// A query's body, taken as axum's `Json` extractor takes one: a JSON
/// content type (else 415 with axum's text), at most the route's body limit.
pub struct QueryBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for QueryBody {
    type Rejection = Response;

    async fn from_request(request: Request, state: &S) -> Result<Self, Response> {
        if !json_content_type(request.headers()) {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "Expected request with `Content-Type: application/json`",
            )
                .into_response());
        }
        Bytes::from_request(request, state)
            .await
            .map(QueryBody)
            .map_err(IntoResponse::into_response)
    }
}

/// axum's rule: `application/json` or `application/*+json`.
fn json_content_type(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<mime::Mime>().ok())
        .is_some_and(|mime| {
            mime.type_() == "application"
                && (mime.subtype() == "json" || mime.suffix().is_some_and(|name| name == "json"))
        })
}

/// An integer a query's array holds.
pub trait ArrayInteger: Sized {
    /// The value of a plain decimal integer: its magnitude and whether a
    /// minus sign came before it; `None` when it is out of range.
    fn from_decimal(negative: bool, magnitude: u64) -> Option<Self>;
}

impl ArrayInteger for u32 {
    fn from_decimal(negative: bool, magnitude: u64) -> Option<Self> {
        if negative {
            return None;
        }
        u32::try_from(magnitude).ok()
    }
}

impl ArrayInteger for i64 {
    fn from_decimal(negative: bool, magnitude: u64) -> Option<Self> {
        if negative {
            // serde_json reads `-0` as a float, which an i64 refuses.
            (magnitude != 0).then(|| 0i64.checked_sub_unsigned(magnitude))?
        } else {
            i64::try_from(magnitude).ok()
        }
    }
}

/// A request whose field `array` is read by hand (and put in place with
/// `array_of`) and whose other fields serde reads, or all of it read by
/// serde when the hand-read path is not sure.
pub fn read<T, Request>(
    body: &[u8],
    array: &str,
    array_of: impl FnOnce(&mut Request) -> &mut Vec<T>,
) -> Result<Request, JsonRejection>
where
    T: ArrayInteger,
    Request: DeserializeOwned,
{
    if let Some(request) = read_by_hand(body, array, array_of) {
        return Ok(request);
    }
    Json::<Request>::from_bytes(body).map(|Json(request)| request)
}

fn read_by_hand<T: ArrayInteger, Request: DeserializeOwned>(
    body: &[u8],
    array: &str,
    array_of: impl FnOnce(&mut Request) -> &mut Vec<T>,
) -> Option<Request> {
    let mut reader = Reader { body, at: 0 };
    let mut values: Option<Vec<T>> = None;
    let mut rest = Map::new();
    reader.skip_space();
    reader.expect(b'{')?;
    reader.skip_space();
    if reader.peek()? != b'}' {
        loop {
            let key = reader.key()?;
            reader.skip_space();
            reader.expect(b':')?;
            reader.skip_space();
            if key == array {
                if values.is_some() {
                    return None;
                }
                values = Some(reader.integers()?);
            } else {
                let value = reader.value()?;
                if rest.insert(key.to_owned(), value).is_some() {
                    return None;
                }
            }
            reader.skip_space();
            match reader.next()? {
                b',' => reader.skip_space(),
                b'}' => break,
                _ => return None,
            }
        }
    } else {
        reader.at += 1;
    }
    reader.skip_space();
    if reader.at != body.len() {
        return None;
    }
    // The request read from the other fields and an empty array, then the
    // array read by hand put in its place.
    let values = values?;
    rest.insert(array.to_owned(), Value::Array(Vec::new()));
    let mut request: Request = serde_json::from_value(Value::Object(rest)).ok()?;
    *array_of(&mut request) = values;
    Some(request)
}

struct Reader<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    fn skip_space(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.at += 1;
        }
    }

    /// A key without escapes or control characters.
    fn key(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.at;
        let length = self.body[start..]
            .iter()
            .position(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)?;
        self.at = start + length;
        self.expect(b'"')?;
        std::str::from_utf8(&self.body[start..start + length]).ok()
    }

    /// Any JSON value, read by serde_json.
    fn value(&mut self) -> Option<Value> {
        let mut values =
            serde_json::Deserializer::from_slice(&self.body[self.at..]).into_iter::<Value>();
        let value = values.next()?.ok()?;
        self.at += values.byte_offset();
        Some(value)
    }

    /// An array of plain decimal integers.
    ///
    /// Kept out of line, with its position in a local: inlined into
    /// [`read_by_hand`], the position lived on the stack and each byte's
    /// step waited on the store of the one before.
    #[inline(never)]
    fn integers<T: ArrayInteger>(&mut self) -> Option<Vec<T>> {
        self.expect(b'[')?;
        // Each integer takes at least two bytes with its comma.
        let mut integers = Vec::with_capacity((self.body.len() - self.at) / 2);
        self.skip_space();
        if self.peek()? == b']' {
            self.at += 1;
            return Some(integers);
        }
        let body = self.body;
        let mut at = self.at;
        loop {
            let (value, length) = integer(&body[at..])?;
            integers.push(value);
            at += length;
            match body.get(at)? {
                b',' if body.get(at + 1).is_some_and(u8::is_ascii_digit) => at += 1,
                _ => {
                    self.at = at;
                    self.skip_space();
                    match self.next()? {
                        b',' => self.skip_space(),
                        b']' => return Some(integers),
                        _ => return None,
                    }
                    at = self.at;
                }
            }
        }
    }
}

/// The plain decimal integer `bytes` start with, and its length in bytes.
fn integer<T: ArrayInteger>(bytes: &[u8]) -> Option<(T, usize)> {
    let negative = *bytes.first()? == b'-';
    let digits = &bytes[usize::from(negative)..];
    let (count, magnitude) = leading_digits(digits);
    if count == 0 || count > MAX_DIGITS || (count > 1 && digits[0] == b'0') {
        return None;
    }
    if matches!(digits.get(count), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    Some((
        T::from_decimal(negative, magnitude)?,
        usize::from(negative) + count,
    ))
}

/// How many decimal digits `bytes` start with (reading stops past
/// [`MAX_DIGITS`]) and their value (meaningless past it), eight at a time
/// while eight bytes are left.
fn leading_digits(bytes: &[u8]) -> (usize, u64) {
    let mut count = 0;
    let mut value = 0u64;
    while let Some(chunk) = bytes.get(count..count + 8) {
        let (digits, chunk_value) = eight_digits(chunk.try_into().expect("eight bytes"));
        value = value
            .wrapping_mul(POWERS_OF_TEN[digits])
            .wrapping_add(chunk_value);
        count += digits;
        if digits < 8 || count > MAX_DIGITS {
            return (count, value);
        }
    }
    while let Some(digit) = bytes.get(count).map(|byte| byte.wrapping_sub(b'0')) {
        if digit > 9 || count > MAX_DIGITS {
            break;
        }
        value = value.wrapping_mul(10).wrapping_add(u64::from(digit));
        count += 1;
    }
    (count, value)
}

/// 10^0 to 10^8.
const POWERS_OF_TEN: [u64; 9] = [
    1,
    10,
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
];

/// How many of `chunk`'s bytes are decimal digits before the first that is
/// not, and their value: the digits are told and combined in one word, a
/// pair, then a quad, then the eight at once (SIMD within a register).
fn eight_digits(chunk: [u8; 8]) -> (usize, u64) {
    const HIGH_NIBBLES: u64 = 0xF0F0_F0F0_F0F0_F0F0;
    const ZEROS: u64 = 0x3030_3030_3030_3030;
    let word = u64::from_le_bytes(chunk);
    // A byte is a digit when its high nibble is 3 and adding 6 keeps it 3
    // (0x30..=0x39); a carry out of a byte that is not one only reaches
    // bytes after the first that is not, which are not counted.
    let not_digits = ((word & HIGH_NIBBLES) ^ ZEROS)
        | ((word.wrapping_add(0x0606_0606_0606_0606) & HIGH_NIBBLES) ^ ZEROS);
    let count = (not_digits.trailing_zeros() / 8) as usize;
    if count == 0 {
        return (0, 0);
    }
    // The first digit is the lowest byte: leading zero bytes pad the
    // digits to eight.
    let digits = (word & 0x0F0F_0F0F_0F0F_0F0F) << (8 * (8 - count));
    let pairs = digits.wrapping_mul(10 << 8 | 1) >> 8 & 0x00FF_00FF_00FF_00FF;
    let quads = pairs.wrapping_mul(100 << 16 | 1) >> 16 & 0x0000_FFFF_0000_FFFF;
    (count, quads.wrapping_mul(10_000 << 32 | 1) >> 32)
}

/// The most digits read by hand: every 19-digit number fits a u64.
const MAX_DIGITS: usize = 19;

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize, PartialEq)]
    struct Query {
        token_ids: Vec<u32>,
        model_name: String,
        #[serde(default)]
        lora_name: Option<String>,
    }

    fn tokens_of(query: &mut Query) -> &mut Vec<u32> {
        &mut query.token_ids
    }

    fn tokens(body: &str) -> Result<Query, u16> {
        read(body.as_bytes(), "token_ids", tokens_of).map_err(|refused| refused.status().as_u16())
    }

    #[test]
    fn the_hand_read_path_reads_what_serde_reads() {
        let bodies = [
            r#"{"token_ids": [1, 2, 3], "model_name": "m"}"#,
            r#" { "model_name" : "m" , "lora_name":null,"token_ids" :[ 0 ,4294967295 ] } "#,
            r#"{"token_ids":[],"model_name":"m","unknown":{"a":[1,2]}}"#,
            r#"{"token_ids":[7],"model_name":"m\u0041","lora_name":"x"}"#,
        ];
        for body in bodies {
            let by_hand = read_by_hand(body.as_bytes(), "token_ids", tokens_of);
            assert!(by_hand.is_some(), "{body} was not read by hand");
            let Json(by_serde) = Json::<Query>::from_bytes(body.as_bytes()).unwrap();
            assert_eq!(by_hand, Some(by_serde), "{body}");
        }
    }

    #[test]
    fn whatever_the_hand_read_path_is_not_sure_of_gets_serdes_answer() {
        // Refused by serde: the status axum's extractor gives.
        for (body, status) in [
            (r#"{"token_ids": [1, -2], "model_name": "m"}"#, 422),
            (r#"{"token_ids": [1.5], "model_name": "m"}"#, 422),
            (r#"{"token_ids": [1e3], "model_name": "m"}"#, 422),
            (r#"{"token_ids": [4294967296], "model_name": "m"}"#, 422),
            (
                r#"{"token_ids": [18446744073709551616], "model_name": "m"}"#,
                422,
            ),
            (r#"{"token_ids": [01], "model_name": "m"}"#, 400),
            (r#"{"token_ids": [1,], "model_name": "m"}"#, 400),
            (
                r#"{"token_ids": [1], "token_ids": [2], "model_name": "m"}"#,
                422,
            ),
            (r#"{"token_ids": [1], "model_name": 5}"#, 422),
            (r#"{"token_ids": [1]}"#, 422),
            (r#"{"model_name": "m"}"#, 422),
            (r#"{"token_ids": [1], "model_name": "m"} x"#, 400),
            (r#"{"token_ids": [1], "model_name": "m""#, 400),
            (r#"[1, 2]"#, 422),
            ("", 400),
        ] {
            assert_eq!(tokens(body).err(), Some(status), "{body}");
        }
        // Accepted by serde though not read by hand: serde's value.
        let query = tokens(r#"{"tok\u0065n_ids": [5], "model_name": "m"}"#).unwrap();
        assert_eq!((query.token_ids, query.model_name.as_str()), (vec![5], "m"));
    }

    #[test]
    fn an_array_with_whitespace_is_read_by_hand_and_one_with_a_bad_part_left_to_serde() {
        // Read by hand: whitespace of JSON's kinds around any integer.
        for array in ["[ ]", "[\t\r\n]", "[ 1 ,\n2\t, 3 ]", "[1, 2, 3]", "[0,10]"] {
            let body = format!(r#"{{"token_ids":{array},"model_name":"m"}}"#);
            let by_hand = read_by_hand(body.as_bytes(), "token_ids", tokens_of);
            let Json(by_serde) = Json::<Query>::from_bytes(body.as_bytes()).unwrap();
            assert_eq!(by_hand, Some(by_serde), "{body}");
        }
        // Left to serde: a part that is no integer, or whitespace JSON does
        // not have (a form feed), or an array that is not of integers.
        for array in [
            "[,1]", "[1,,2]", "[1,]", "[,]", "[1 2]", "[\u{c}1]", "[1\u{c}]", "[\"]\"]", "[[1]]",
            "[1]]", "[-]", "[1-]", "[ - 1]", "[00]", "[1.]", "[1e1]",
        ] {
            let body = format!(r#"{{"token_ids":{array},"model_name":"m"}}"#);
            assert_eq!(
                read_by_hand(body.as_bytes(), "token_ids", tokens_of),
                None,
                "{body}"
            );
            assert!(
                Json::<Query>::from_bytes(body.as_bytes()).is_err(),
                "{body} is one serde reads"
            );
        }
    }

    #[test]
    fn integers_of_every_length_read_by_hand_as_serde_reads_them() {
        #[derive(Debug, Deserialize, PartialEq)]
        struct Hashes {
            block_hashes: Vec<i64>,
        }
        fn hashes_of(request: &mut Hashes) -> &mut Vec<i64> {
            &mut request.block_hashes
        }
        // Each length of one to twenty digits, alone, at the array's end
        // and before other numbers (the eight-byte reads cross each of
        // these boundaries), signed and not.
        for digits in 1..=20u32 {
            let magnitude = u64::MAX / 10u64.pow(20 - digits).max(1) % 10u64.pow(digits.min(19));
            let number =
                format!("{magnitude:0>width$}", width = digits as usize).replacen('0', "1", 1);
            for sign in ["", "-"] {
                for (array, longest) in [
                    (format!("[{sign}{number}]"), digits),
                    (format!("[7,{sign}{number}]"), digits),
                    (
                        format!("[{sign}{number},12345678,9 , {sign}{number}]"),
                        digits.max(8),
                    ),
                    (format!("[ {sign}{number} ,{sign}{number}0,3]"), digits + 1),
                ] {
                    let body = format!(r#"{{"block_hashes":{array}}}"#);
                    let by_hand = read_by_hand(body.as_bytes(), "block_hashes", hashes_of);
                    let by_serde = Json::<Hashes>::from_bytes(body.as_bytes())
                        .map(|Json(request)| request)
                        .ok();
                    match by_hand {
                        Some(by_hand) => assert_eq!(Some(by_hand), by_serde, "{body}"),
                        // Only what serde refuses, or a number longer than
                        // any that fits, is left to serde.
                        None => assert!(
                            by_serde.is_none() || longest > MAX_DIGITS as u32,
                            "{body} was left to serde"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn eight_bytes_are_told_and_valued_as_a_digit_at_a_time_would() {
        // Every byte after each run of leading digits (0 to 8 of them),
        // whatever the digits, whatever follows.
        for length in 0..=8 {
            for stop in 0..=255u8 {
                let mut chunk = *b"98765432";
                chunk[..length].copy_from_slice(&b"31415926"[..length]);
                if length < 8 {
                    chunk[length] = stop;
                    chunk[length + 1..].fill(stop.wrapping_mul(7));
                }
                let expected_count = chunk
                    .iter()
                    .take_while(|byte| byte.is_ascii_digit())
                    .count();
                let expected_value = chunk[..expected_count]
                    .iter()
                    .fold(0u64, |value, digit| value * 10 + u64::from(digit - b'0'));
                assert_eq!(
                    eight_digits(chunk),
                    (expected_count, expected_value),
                    "{chunk:?}"
                );
            }
        }
    }

    #[test]
    fn signed_arrays_take_the_whole_range_of_i64() {
        #[derive(Debug, Deserialize)]
        struct Hashes {
            block_hashes: Vec<i64>,
        }
        fn hashes_of(request: &mut Hashes) -> &mut Vec<i64> {
            &mut request.block_hashes
        }
        let by_hand = |body: &str| read_by_hand(body.as_bytes(), "block_hashes", hashes_of);
        let all =
            by_hand(r#"{"block_hashes": [-9223372036854775808, 9223372036854775807, -1, 0]}"#);
        assert_eq!(all.unwrap().block_hashes, [i64::MIN, i64::MAX, -1, 0]);
        assert!(by_hand(r#"{"block_hashes": [-0]}"#).is_none());
        let too_low = r#"{"block_hashes": [-9223372036854775809]}"#;
        assert!(by_hand(too_low).is_none());
        let refused = read(too_low.as_bytes(), "block_hashes", hashes_of);
        assert_eq!(
            refused.err().map(|refused| refused.status().as_u16()),
            Some(422)
        );
    }
}
