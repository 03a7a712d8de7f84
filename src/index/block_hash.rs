//! Dynamo's local block hash: what a query's tokens and a stored block's
//! tokens are both reduced to, so a child is found under its parent without
//! knowing any engine's own hash function.
//!
//! Invariant: XXH3-64 over each *full* block's tokens as u32 little-endian,
//! seeded with 1337 plus (wrapping) XXH3-64 of the LoRA name (seed 0) plus
//! XXH3-64 of the cache salt (seed 1); an empty name or salt counts as
//! absent. A trailing partial block has no hash. Pinned by vectors computed
//! with Dynamo 1.6.1's `compute_block_hash_for_seq` (tests below).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Dynamo's base seed.
const BASE_SEED: u64 = 1337;

/// The seed every block of one request (or one stored event) is hashed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HashSeed(u64);

impl HashSeed {
    /// The seed for a LoRA adapter and a cache salt (either may be absent).
    pub fn new(lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        let mut seed = BASE_SEED;
        if let Some(name) = lora_name.filter(|name| !name.is_empty()) {
            seed = seed.wrapping_add(xxh3_64(name.as_bytes()));
        }
        if let Some(salt) = cache_salt.filter(|salt| !salt.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        HashSeed(seed)
    }

    /// One block's hash.
    pub fn block(self, tokens: &[u32]) -> u64 {
        let mut bytes = [0u8; 4 * 64];
        if tokens.len() <= 64 {
            for (chunk, token) in bytes.chunks_exact_mut(4).zip(tokens) {
                chunk.copy_from_slice(&token.to_le_bytes());
            }
            return xxh3_64_with_seed(&bytes[..4 * tokens.len()], self.0);
        }
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|token| token.to_le_bytes())
            .collect();
        xxh3_64_with_seed(&bytes, self.0)
    }

    /// The hash of every full block of `tokens`, in order.
    pub fn blocks(self, tokens: &[u32], block_size: u32) -> Vec<u64> {
        if block_size == 0 {
            return Vec::new();
        }
        tokens
            .chunks_exact(block_size as usize)
            .map(|block| self.block(block))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Dynamo 1.6.1: compute_block_hash_for_seq(list(range(8)), 4, lora_name=…,
    // cache_namespace=…).
    #[test]
    fn hashes_equal_dynamos_for_plain_lora_salted_and_both() {
        let tokens: Vec<u32> = (0..8).collect();
        assert_eq!(
            HashSeed::new(None, None).blocks(&tokens, 4),
            [9143094415614847814, 12124091508212882195]
        );
        assert_eq!(
            HashSeed::new(Some("a"), None).blocks(&tokens, 4),
            [5423431825673666632, 8531018594073694330]
        );
        assert_eq!(
            HashSeed::new(None, Some("s")).blocks(&tokens, 4),
            [555386108965864115, 12836903724012423413]
        );
        assert_eq!(
            HashSeed::new(Some("a"), Some("s")).blocks(&tokens, 4),
            [15208533456611274396, 14764978328445311438]
        );
    }

    #[test]
    fn empty_names_count_as_absent_and_partial_blocks_have_no_hash() {
        let tokens: Vec<u32> = (0..11).collect();
        assert_eq!(
            HashSeed::new(Some(""), Some("")).blocks(&tokens, 4),
            HashSeed::new(None, None).blocks(&tokens, 4)
        );
        assert_eq!(HashSeed::new(None, None).blocks(&tokens, 4).len(), 2);
        assert!(HashSeed::new(None, None).blocks(&tokens, 0).is_empty());
    }

    #[test]
    fn long_blocks_hash_as_their_bytes() {
        let tokens: Vec<u32> = (0..100).collect();
        let bytes: Vec<u8> = tokens
            .iter()
            .flat_map(|token| token.to_le_bytes())
            .collect();
        assert_eq!(
            HashSeed::new(None, None).block(&tokens),
            xxh3_64_with_seed(&bytes, BASE_SEED)
        );
    }
}
