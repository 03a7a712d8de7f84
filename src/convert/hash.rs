//! Folding engine block hashes into the router's int64 identity.
//!
//! Invariant: the integer and the byte-string form of the same engine hash fold
//! to the same `i64` (vLLM publishes either the low 64 bits of a digest as an
//! unsigned int or the whole digest as bytes; both must name one block), and a
//! signed int64 (SGLang, old vLLM) folds to itself.

/// Folds an integer hash: the value modulo 2^64, read as two's complement.
///
/// Takes anything that widens losslessly to `i128`, so a `u64` at or above
/// 2^63 and a negative `i64` with the same 64 bits fold to the same value.
pub fn fold_int(value: impl Into<i128>) -> i64 {
    // `as` from i128 to i64 keeps the low 64 bits: exactly "mod 2^64, two's complement".
    value.into() as i64
}

/// Folds a byte-string hash: its last 8 bytes read big-endian as two's complement.
///
/// A string shorter than 8 bytes is read as if left-padded with zeros, i.e. as
/// the unsigned big-endian number it spells (so `[]` folds to 0 and `[0xff]`
/// to 255). No engine sends such short digests; the rule only keeps the
/// function total.
pub fn fold_bytes(bytes: &[u8]) -> i64 {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    let mut word = [0u8; 8];
    word[8 - tail.len()..].copy_from_slice(tail);
    i64::from_be_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsigned_hash_at_or_above_2_pow_63_folds_to_a_negative_int64() {
        assert_eq!(fold_int(1u64 << 63), i64::MIN);
        assert_eq!(fold_int(u64::MAX), -1);
        assert_eq!(
            fold_int(15_760_518_052_499_183_552u64),
            -2_686_226_021_210_368_064
        );
    }

    #[test]
    fn a_signed_hash_folds_to_itself() {
        for v in [0i64, 1, -1, -42, i64::MIN, i64::MAX] {
            assert_eq!(fold_int(v), v);
        }
    }

    #[test]
    fn an_integer_beyond_64_bits_keeps_its_low_64_bits() {
        assert_eq!(fold_int((1i128 << 64) + 5), 5);
        assert_eq!(fold_int(-(1i128 << 64) - 1), -1);
    }

    #[test]
    fn a_32_byte_digest_folds_to_its_last_8_bytes_big_endian() {
        // vllm-0.33.0/stored-bytes-sha256: the digest whose int form is 10374476608544502691.
        let digest: Vec<u8> = (0..32)
            .map(|i| {
                let hex = "5fd924568562ed8cf21d775f863f76b318fd137f938e0e098ff98b8256e4f3a3";
                u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()
            })
            .collect();
        assert_eq!(fold_bytes(&digest), -8_072_267_465_165_048_925);
        assert_eq!(fold_bytes(&digest), fold_int(10_374_476_608_544_502_691u64));
    }

    #[test]
    fn exactly_8_bytes_fold_like_the_same_int() {
        let v: u64 = 0xc9f1_e2d3_a4b5_c6d7;
        assert_eq!(fold_bytes(&v.to_be_bytes()), fold_int(v));
    }

    #[test]
    fn bytes_shorter_than_8_are_left_padded_with_zeros() {
        assert_eq!(fold_bytes(&[]), 0);
        assert_eq!(fold_bytes(&[0xff]), 255);
        assert_eq!(fold_bytes(&[0x01, 0x00]), 256);
        assert_eq!(fold_bytes(&[0xff; 7]), 0x00ff_ffff_ffff_ffff);
    }
}
