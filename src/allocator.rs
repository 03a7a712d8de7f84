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
//! walk of its own: 7–10% less CPU per event at one subscriber, for about
//! 3.5 MB more idle RSS, each heap's first touched huge page
//! (BENCHMARKS.md, issue 22, "Session 25").

#[cfg(all(target_os = "linux", target_env = "gnu"))]
use std::ffi::{OsStr, OsString};

/// Bytes a heap grows by beyond what a request needs, so the drain's
/// steady allocations stop growing the arena a page run at a time. Only
/// address space: untouched pages are never resident.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TOP_PAD: i32 = 64 << 20;

/// Free bytes at a heap's top kept rather than handed back, so the memory
/// one cycle frees is there for the next instead of being trimmed and
/// faulted in again. A burst's memory stays resident up to this much.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: i32 = 256 << 20;

/// Allocations from this size up get pages of their own (`mmap`). Fixed
/// rather than glibc's sliding threshold, so large batch buffers do not
/// flip between the two ways from one cycle to the next.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
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

/// The first glibc with [`HUGE_PAGE_TUNABLE`] (major, minor).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const FIRST_GLIBC_WITH_THE_TUNABLE: (u32, u32) = (2, 35);

/// What a failed restart leaves, said once by whoever reports it.
pub const RESTART_FAILED: &str = "could not start again with malloc asking for huge pages; the heap stays on the kernel's default pages";

/// Why [`restart_asking_for_huge_pages`] returned: it does not when it
/// starts the process again.
#[derive(Debug)]
pub enum HugePages {
    /// Nothing to ask for: the kernel gives huge pages to all memory or to
    /// none, `GLIBC_TUNABLES` already names the tunable (a user's choice,
    /// or this process started again), this glibc has no such tunable, or
    /// the process cannot be started again as itself (secure mode, a
    /// loader started by hand).
    NothingToAsk,
    /// Starting again failed; the heap stays on the kernel's default pages.
    RestartFailed(std::io::Error),
}

/// Starts this process again, same arguments, name and pid, with malloc asking
/// for huge pages, if the kernel gives them only on request and the
/// environment does not already say. Call before any thread is spawned:
/// the process is replaced, only its pid and inherited descriptors stay.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn restart_asking_for_huge_pages() -> HugePages {
    use std::os::unix::process::CommandExt;

    // In secure mode (setuid, file capabilities) glibc drops the tunable
    // from the environment it starts with: the process would start again
    // and again. SAFETY: `getauxval` reads the vector the kernel gave.
    let secure = unsafe { libc::getauxval(libc::AT_SECURE) } != 0;
    if secure || !glibc_at_least(glibc_version(), FIRST_GLIBC_WITH_THE_TUNABLE) {
        return HugePages::NothingToAsk;
    }
    let mode = std::fs::read_to_string(HUGE_PAGE_MODE_FILE).unwrap_or_default();
    let tunables = std::env::var_os("GLIBC_TUNABLES");
    let Some(tunables) = tunables_asking_for_huge_pages(&mode, tunables.as_deref()) else {
        return HugePages::NothingToAsk;
    };
    let mut args = std::env::args_os();
    let Some(program) = args.next() else {
        return HugePages::NothingToAsk;
    };
    // By its own path, not `/proc/self/exe`: the kernel names a process
    // after the file it runs (`/proc/PID/comm`, what `ps`, `pkill` and
    // `top` show), and that one would rename it `exe`. A binary run by a
    // loader started by hand (`ld.so ./kvgate`) is not the file running.
    let binary = match std::env::current_exe() {
        Ok(binary) => binary,
        Err(error) => return HugePages::RestartFailed(error),
    };
    if binary.file_name() != std::path::Path::new(&program).file_name() {
        return HugePages::NothingToAsk;
    }
    let error = std::process::Command::new(binary)
        .arg0(program)
        .args(args)
        .env("GLIBC_TUNABLES", tunables)
        .exec();
    HugePages::RestartFailed(error)
}

/// Another C library has no such tunable.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn restart_asking_for_huge_pages() -> HugePages {
    HugePages::NothingToAsk
}

/// For a bench that runs the gateway's code in process, so it measures the
/// heap `kvgate serve` runs on: huge pages asked for as the gateway asks
/// (the bench may start again) and malloc tuned. Binaries only.
pub fn bench_on_the_gateways_heap() {
    if let HugePages::RestartFailed(error) = restart_asking_for_huge_pages() {
        eprintln!("{RESTART_FAILED}: {error}");
    }
    let refused = tune();
    if !refused.is_empty() {
        eprintln!("malloc kept its defaults for {refused:?}");
    }
}

/// The running glibc's version, as `2.36`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_version() -> &'static str {
    // SAFETY: glibc returns a static NUL-terminated string.
    let version = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    version.to_str().unwrap_or_default()
}

/// Whether `version` (`major.minor[...]`) is `first` or later.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_at_least(version: &str, first: (u32, u32)) -> bool {
    let mut numbers = version.split('.').map(|number| number.parse::<u32>().ok());
    match (numbers.next().flatten(), numbers.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= first,
        _ => false,
    }
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
    fn the_tunable_is_asked_for_only_of_a_glibc_that_has_it() {
        let first = super::FIRST_GLIBC_WITH_THE_TUNABLE;
        assert!(super::glibc_at_least("2.35", first));
        assert!(super::glibc_at_least("2.36", first));
        assert!(super::glibc_at_least("3.0", first));
        assert!(!super::glibc_at_least("2.34", first));
        assert!(!super::glibc_at_least("2.9", first));
        assert!(!super::glibc_at_least("", first));
        assert!(!super::glibc_at_least("unknown", first));
        // This test runs on the C library it was built for.
        assert!(super::glibc_version().starts_with("2."));
    }

    #[test]
    fn tunables_that_are_not_utf8_are_kept_byte_for_byte() {
        use std::os::unix::ffi::{OsStrExt, OsStringExt};

        let set = OsStr::from_bytes(b"glibc.x=\xff");
        let asking = super::tunables_asking_for_huge_pages("always [madvise] never", Some(set));
        assert_eq!(
            asking.map(OsStringExt::into_vec),
            Some(b"glibc.x=\xff:glibc.malloc.hugetlb=1".to_vec())
        );
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
        // No such file (a kernel without them, sysfs not mounted).
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
