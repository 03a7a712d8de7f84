//! A hint that asks the CPU to bring memory into the cache before the code
//! reads it.
//!
//! Invariant: a hint only. It reads nothing the program sees and cannot
//! fault, whatever the address, so any pointer may be passed, even one to
//! memory freed since. Walks of the live state use it where the next read
//! is known well ahead and would otherwise wait for a cache miss.

/// Asks the CPU to fetch the cache line at `data`.
#[inline]
pub(crate) fn prefetch<T>(data: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `prefetcht0` only hints the cache; it dereferences nothing
    // and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(data.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}
