//! The heap the `kvgate` binary runs on: glibc's malloc, told at start to
//! grow and shrink its heaps in large steps.
//!
//! Invariant: only binaries call [`tune`] (`src/main.rs` and the benches
//! that run the gateway's code in process, so a bench measures the heap
//! the binary uses); the library never does, so embedding it changes no
//! heap of someone else's.
//!
//! Chosen by measurement against mimalloc and jemalloc (BENCHMARKS.md,
//! issue 22, "Allocator and hashers"). With the defaults, the one worker
//! thread's arena grew and was trimmed back 180–250 times a second
//! (`mprotect`, at 20k events/s). Larger steps remove that churn, for as
//! much less CPU per event as mimalloc gave, at no cost in idle or peak
//! memory (mimalloc doubled idle RSS; jemalloc saved nothing), and no C
//! allocator has to be compiled.

/// Bytes a heap grows by beyond what a request needs, so the drain's
/// steady allocations stop growing the arena a page run at a time. Only
/// address space: untouched pages are never resident.
const TOP_PAD: i32 = 64 << 20;

/// Free bytes at a heap's top kept rather than handed back, so the memory
/// one cycle frees is there for the next instead of being trimmed and
/// faulted in again. A burst's memory stays resident up to this much.
const TRIM_THRESHOLD: i32 = 256 << 20;

/// Allocations from this size up get pages of their own (`mmap`). Fixed
/// rather than glibc's sliding threshold, so large batch buffers do not
/// flip between the two ways from one cycle to the next.
const MMAP_THRESHOLD: i32 = 4 << 20;

/// Sets the heap's parameters; call first thing in `main`. Returns the
/// names of any glibc refused (none on a glibc that has them all).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn tune() -> Vec<&'static str> {
    [
        (libc::M_TOP_PAD, TOP_PAD, "M_TOP_PAD"),
        (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD, "M_TRIM_THRESHOLD"),
        (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD, "M_MMAP_THRESHOLD"),
    ]
    .into_iter()
    // SAFETY: mallopt only sets malloc's parameters, under malloc's own
    // lock, and any value is valid for these three (glibc checks them).
    .filter(|&(parameter, value, _)| unsafe { libc::mallopt(parameter, value) } != 1)
    .map(|(_, _, name)| name)
    .collect()
}

/// Another C library keeps its own defaults.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() -> Vec<&'static str> {
    Vec::new()
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    #[test]
    fn glibc_takes_every_parameter() {
        // This test binary's heap is tuned as a side effect; no test
        // depends on the heap's parameters.
        assert_eq!(super::tune(), Vec::<&str>::new());
    }
}
