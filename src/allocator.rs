//! The heap the `kvgate` binary runs on: glibc's malloc, told at start to
//! grow and shrink its heaps in large steps, and, where the kernel gives
//! transparent huge pages only to memory that asks for them, to ask for
//! them for every heap it makes.
//!
//! Invariant: only binaries call [`tune`] and
//! [`restart_asking_for_huge_pages`] (`src/main.rs`, the latter for `kvgate
//! serve` only, and the benches that run the gateway's code in process,
//! so a bench measures the heap the binary uses); the library never does,
//! so embedding it changes no heap of someone else's. A tunable the user
//! set is never overridden.
//!
//! Chosen by measurement against mimalloc and jemalloc (BENCHMARKS.md,
//! issue 22, "Allocator and hashers"). With the defaults, the one worker
//! thread's arena grew and was trimmed back 180–250 times a second
//! (`mprotect`, at 20k events/s). Larger steps remove that churn, for as
//! much less CPU per event as mimalloc gave, at no cost in idle or peak
//! memory (mimalloc doubled idle RSS; jemalloc saved nothing), and no C
//! allocator has to be compiled. Huge pages: the drain looks up blocks
//! scattered over megabytes of state once per engine message, and with
//! 4 KiB pages under a hypervisor each lookup's address translation is a
//! walk of its own (BENCHMARKS.md, issue 22, "Session 25").

#[cfg(all(target_os = "linux", target_env = "gnu"))]
use std::ffi::{OsStr, OsString};

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

/// Where the kernel says which memory gets transparent huge pages: all,
/// only what asks (`madvise`, most distributions' default), or none.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HUGE_PAGE_MODE_FILE: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The glibc tunable (2.35 and later) with which malloc asks for huge pages
/// (`madvise`) for every heap it makes or grows. Tunables are read from the
/// environment once, as a process starts: setting one means starting again.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const HUGE_PAGE_TUNABLE: &str = "glibc.malloc.hugetlb";

/// Why [`restart_asking_for_huge_pages`] returned: it does not when it
/// starts the process again.
#[derive(Debug)]
pub enum HugePages {
    /// Nothing to ask for: the kernel gives huge pages to all memory or to
    /// none, or `GLIBC_TUNABLES` already names the tunable (a user's
    /// choice, or this process started again).
    AsTheyAre,
    /// Starting again failed (no `/proc`, say); the heap stays on the
    /// kernel's default pages.
    RestartFailed(std::io::Error),
}

/// Starts this process again, same arguments and pid, with malloc asking
/// for huge pages, if the kernel gives them only on request and the
/// environment does not already say. Call before any thread is spawned
/// or file opened: the process is replaced, only its pid and open files
/// stay.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn restart_asking_for_huge_pages() -> HugePages {
    use std::os::unix::process::CommandExt;

    let mode = std::fs::read_to_string(HUGE_PAGE_MODE_FILE).unwrap_or_default();
    let tunables = std::env::var_os("GLIBC_TUNABLES");
    let Some(tunables) = tunables_asking_for_huge_pages(&mode, tunables.as_deref()) else {
        return HugePages::AsTheyAre;
    };
    let mut args = std::env::args_os();
    let program = args.next().unwrap_or_else(|| "kvgate".into());
    let error = std::process::Command::new("/proc/self/exe")
        .arg0(program)
        .args(args)
        .env("GLIBC_TUNABLES", tunables)
        .exec();
    HugePages::RestartFailed(error)
}

/// Another C library has no such tunable.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn restart_asking_for_huge_pages() -> HugePages {
    HugePages::AsTheyAre
}

/// `GLIBC_TUNABLES` with malloc asking for huge pages added to what the
/// user set, when the kernel's `mode` (the selected one in brackets) gives
/// them only on request and `tunables` does not name the tunable yet.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tunables_asking_for_huge_pages(mode: &str, tunables: Option<&OsStr>) -> Option<OsString> {
    use std::os::unix::ffi::OsStrExt;

    if !mode.split_whitespace().any(|word| word == "[madvise]") {
        return None;
    }
    let set = tunables.map(OsStr::as_bytes).unwrap_or_default();
    let named = set.split(|&byte| byte == b':').any(|entry| {
        entry.split(|&byte| byte == b'=').next() == Some(HUGE_PAGE_TUNABLE.as_bytes())
    });
    if named {
        return None;
    }
    let mut asking = OsStr::from_bytes(set).to_os_string();
    if !set.is_empty() {
        asking.push(":");
    }
    asking.push(HUGE_PAGE_TUNABLE);
    asking.push("=1");
    Some(asking)
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use std::ffi::OsStr;

    #[test]
    fn glibc_takes_every_parameter() {
        // This test binary's heap is tuned as a side effect; no test
        // depends on the heap's parameters.
        assert_eq!(super::tune(), Vec::<&str>::new());
    }

    fn asking(mode: &str, tunables: Option<&str>) -> Option<String> {
        super::tunables_asking_for_huge_pages(mode, tunables.map(OsStr::new))
            .map(|tunables| tunables.into_string().unwrap())
    }

    #[test]
    fn huge_pages_are_asked_for_only_where_the_kernel_gives_them_on_request() {
        let on_request = "always [madvise] never\n";
        assert_eq!(
            asking(on_request, None).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
        assert_eq!(asking("[always] madvise never\n", None), None);
        assert_eq!(asking("always madvise [never]\n", None), None);
        // No such file (not Linux, no sysfs): nothing to ask for.
        assert_eq!(asking("", None), None);
    }

    #[test]
    fn a_tunable_the_user_set_is_kept_and_the_ask_goes_beside_the_others() {
        let on_request = "always [madvise] never\n";
        assert_eq!(asking(on_request, Some("glibc.malloc.hugetlb=0")), None);
        assert_eq!(
            asking(
                on_request,
                Some("glibc.malloc.tcache_count=16:glibc.malloc.hugetlb=2")
            ),
            None
        );
        assert_eq!(
            asking(on_request, Some("glibc.malloc.tcache_count=16")).as_deref(),
            Some("glibc.malloc.tcache_count=16:glibc.malloc.hugetlb=1")
        );
        // A name that only starts like it is another tunable.
        assert_eq!(
            asking(on_request, Some("glibc.malloc.hugetlbx=0")).as_deref(),
            Some("glibc.malloc.hugetlbx=0:glibc.malloc.hugetlb=1")
        );
        assert_eq!(
            asking(on_request, Some("")).as_deref(),
            Some("glibc.malloc.hugetlb=1")
        );
    }
}
