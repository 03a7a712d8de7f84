//! The heap the `kvgate` binary runs on: glibc's malloc, told at start to
//! grow and shrink its heaps in large steps, and, where the kernel gives
//! transparent huge pages only to memory that asks for them, to ask for
//! them for every heap it makes (a tunable, read as a process starts: the
//! gateway starts itself again with it, and again while glibc did not
//! take it, a bounded number of times).
//!
//! Invariant: only binaries call [`tune`] and
//! [`restart_asking_for_huge_pages`] (`src/main.rs`, the latter for `kvgate
//! serve` only, and the benches that run the gateway's code in process,
//! so a bench measures the heap the binary uses); the library never does,
//! so embedding it changes no heap of someone else's. A tunable the user
//! set is never overridden.
//!
//! Chosen by measurement against mimalloc and jemalloc (BENCHMARKS.md,
//! "Allocator and hashers"). With the defaults, the one worker
//! thread's arena grew and was trimmed back 180–250 times a second
//! (`mprotect`, at 20k events/s). Larger steps remove that churn, for as
//! much less CPU per event as mimalloc gave, at no cost in idle or peak
//! memory (mimalloc doubled idle RSS; jemalloc saved nothing), and no C
//! allocator has to be compiled. Huge pages: the drain looks up blocks
//! scattered over megabytes of state once per engine message, and with
//! 4 KiB pages under a hypervisor each lookup's address translation is a
//! walk of its own: 7–10% less CPU per event at one subscriber, for about
//! 3.5 MB more idle RSS, each heap's first touched huge page
//! (BENCHMARKS.md, "Huge pages for the heap").

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

/// Hands every free page of every heap back to the kernel (`malloc_trim`),
/// however large [`TRIM_THRESHOLD`] lets a heap's free memory grow. For a
/// process whose memory is one structure that a burst builds (the fleet
/// index: tables that doubled, a burst's messages in flight), so what it
/// holds afterwards is that structure, not the burst's garbage. Takes
/// each heap's lock in turn: call it off the serving path.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn return_free_pages() {
    // SAFETY: malloc_trim only walks malloc's own free lists, under
    // malloc's locks, and any pad is valid.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Another C library keeps its own ways.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn return_free_pages() {}

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

/// What restarts that all missed leave, said once by whoever reports it.
pub const NOT_TAKEN: &str = "glibc did not take the huge page tunable in any restart; the heap stays on the kernel's default pages";

/// Set by a restart to how many restarts asked glibc for huge pages so
/// far, for the next start to read.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const RESTARTS_VARIABLE: &str = "KVGATE_HUGE_PAGE_RESTARTS";

/// How many restarts may ask before the heap is left on small pages.
/// glibc 2.36 (Debian 12's, the image's) reads the kernel's mode into a
/// buffer it does not end with a NUL, so whether it takes the tunable
/// depends on the byte after it, which the address layout (random at each
/// start) leaves there: 25–80% of starts took it on the benchmark host
/// (BENCHMARKS.md, "Huge pages for the heap"). A start takes about 4 ms;
/// at one chance in four, all 32 miss once in 10,000.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MOST_RESTARTS: u32 = 32;

/// Why [`restart_asking_for_huge_pages`] returned: it does not when it
/// starts the process again.
#[derive(Debug)]
pub enum HugePages {
    /// Nothing to ask for: the kernel gives huge pages to all memory or to
    /// none, `GLIBC_TUNABLES` already names the tunable and kvgate did not
    /// set it (a user's choice), this glibc has no such tunable, or the
    /// process cannot be started again as itself (secure mode, a loader
    /// started by hand).
    NothingToAsk,
    /// malloc asks for huge pages for every heap it makes.
    Asking {
        /// The restart glibc took the tunable in (1 is the first).
        restarts: u32,
    },
    /// Started again with the tunable, but whether glibc took it cannot be
    /// told (no `/proc/self/smaps` to read, no main heap in it).
    Unchecked {
        /// Restarts so far.
        restarts: u32,
    },
    /// glibc took the tunable in no restart; the heap stays on the
    /// kernel's default pages.
    NotTaken {
        /// How many restarts asked.
        restarts: u32,
    },
    /// Starting again failed; the heap stays on the kernel's default pages.
    RestartFailed(std::io::Error),
}

/// Starts this process again, same arguments, name and pid, with malloc
/// asking for huge pages, if the kernel gives them only on request and the
/// environment does not already say; and again, up to [`MOST_RESTARTS`]
/// times in all, while glibc did not take the tunable. Call before any
/// thread is spawned: the process is replaced, only its pid and inherited
/// descriptors stay.
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
    let restarts = std::env::var(RESTARTS_VARIABLE)
        .ok()
        .and_then(|restarts| restarts.parse().ok())
        .unwrap_or(0);
    let mode = std::fs::read_to_string(HUGE_PAGE_MODE_FILE).unwrap_or_default();
    let tunables = std::env::var_os("GLIBC_TUNABLES");
    let tunables = match next_start(
        restarts,
        &mode,
        tunables.as_deref(),
        malloc_asks_for_huge_pages,
    ) {
        Ok(tunables) => tunables,
        Err(outcome) => return outcome,
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
        .env(RESTARTS_VARIABLE, (restarts + 1).to_string())
        .exec();
    HugePages::RestartFailed(error)
}

/// The `GLIBC_TUNABLES` to start again with, or why not to: a start after
/// `restarts` restarts, with the kernel's THP `mode` and the `tunables`
/// it was given, where `malloc_asks` tells whether glibc took them
/// (`None`: cannot be told). The first start adds the ask to the user's
/// tunables; a restart checks that glibc took the one kvgate set and
/// starts again with it while it did not, [`MOST_RESTARTS`] times at most.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn next_start(
    restarts: u32,
    mode: &str,
    tunables: Option<&OsStr>,
    malloc_asks: impl FnOnce() -> Option<bool>,
) -> Result<OsString, HugePages> {
    if restarts == 0 {
        return tunables_asking_for_huge_pages(mode, tunables).ok_or(HugePages::NothingToAsk);
    }
    if huge_page_tunable(tunables) != Some(b"1") {
        // A tunable kvgate did not set (an environment edited by hand):
        // nothing to try again.
        return Err(HugePages::NothingToAsk);
    }
    match malloc_asks() {
        Some(true) => Err(HugePages::Asking { restarts }),
        None => Err(HugePages::Unchecked { restarts }),
        Some(false) if restarts >= MOST_RESTARTS => Err(HugePages::NotTaken { restarts }),
        Some(false) => Ok(tunables.unwrap_or_default().to_os_string()),
    }
}

/// Whether this process's malloc asks for huge pages: glibc asks for the
/// main heap's first growth, before `main`, once it took the tunable.
/// `None` where that cannot be told (no `/proc`, no main heap).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn malloc_asks_for_huge_pages() -> Option<bool> {
    let smaps = std::fs::File::open("/proc/self/smaps").ok()?;
    heap_asks_for_huge_pages(std::io::BufReader::new(smaps))
}

/// Whether the main heap of `smaps` (mappings as `/proc/PID/smaps` lists
/// them; the main heap's path column is `[heap]`) asked for huge pages:
/// its `hg` flag. `None` without such a heap. Reads no further than the
/// heap's flags; lines are bytes, as a mapped file's path may be.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_asks_for_huge_pages(smaps: impl std::io::BufRead) -> Option<bool> {
    fn words(line: &[u8]) -> impl Iterator<Item = &[u8]> {
        line.split(u8::is_ascii_whitespace)
            .filter(|word| !word.is_empty())
    }
    let mut lines = smaps.split(b'\n').map_while(Result::ok);
    // address, permissions, offset, device, inode, path
    lines
        .by_ref()
        .find(|line| words(line).nth(5) == Some(b"[heap]"))?;
    let flags = lines.find_map(|line| {
        line.strip_prefix(b"VmFlags:")
            .map(|flags| words(flags).any(|flag| flag == b"hg"))
    })?;
    Some(flags)
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
    match restart_asking_for_huge_pages() {
        HugePages::RestartFailed(error) => eprintln!("{RESTART_FAILED}: {error}"),
        HugePages::NotTaken { restarts } => eprintln!("{NOT_TAKEN} ({restarts} restarts)"),
        HugePages::NothingToAsk | HugePages::Asking { .. } | HugePages::Unchecked { .. } => {}
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
    if huge_page_tunable(tunables).is_some() {
        return None;
    }
    let set = tunables.map(OsStr::as_bytes).unwrap_or_default();
    let mut asking = OsStr::from_bytes(set).to_os_string();
    if !set.is_empty() {
        asking.push(":");
    }
    asking.push(HUGE_PAGE_TUNABLE);
    asking.push("=1");
    Some(asking)
}

/// The value `tunables` gives [`HUGE_PAGE_TUNABLE`], if it names it: the
/// last one, as glibc reads them.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn huge_page_tunable(tunables: Option<&OsStr>) -> Option<&[u8]> {
    use std::os::unix::ffi::OsStrExt;

    let set = tunables.map(OsStr::as_bytes).unwrap_or_default();
    set.rsplit(|&byte| byte == b':').find_map(|entry| {
        let (name, value) = entry.split_at(entry.iter().position(|&byte| byte == b'=')?);
        (name == HUGE_PAGE_TUNABLE.as_bytes()).then_some(&value[1..])
    })
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

    /// Mappings as `/proc/PID/smaps` lists them, the main heap's flags
    /// `heap_flags`.
    fn smaps(heap_flags: &str) -> String {
        format!(
            "55d0c0a00000-55d0c0a21000 r--p 00000000 fe:00 325843   /usr/bin/kvgate\n\
             Size:                132 kB\n\
             VmFlags: rd mr mw me dw hg\n\
             55d0c2a00000-55d0c6a25000 rw-p 00000000 00:00 0                          [heap]\n\
             Size:              65684 kB\n\
             AnonHugePages:         0 kB\n\
             VmFlags: {heap_flags}\n\
             7f80f4000000-7f80f8000000 rw-p 00000000 00:00 0\n\
             VmFlags: rd wr mr mw me ac sd hg\n"
        )
    }

    #[test]
    fn only_the_main_heaps_own_flags_tell_whether_malloc_asks() {
        let asks = |smaps: &[u8]| super::heap_asks_for_huge_pages(smaps);
        assert_eq!(
            asks(smaps("rd wr mr mw me ac sd hg").as_bytes()),
            Some(true)
        );
        assert_eq!(
            asks(smaps("rd wr mr mw me ac sd").as_bytes()),
            Some(false),
            "the mappings before and after the heap ask, not the heap"
        );
        // A file named like the heap is not the heap; a path that is not
        // UTF-8 before the heap does not end the reading.
        let mut tricky = b"55d0c0a00000-55d0c0a21000 r--p 00000000 fe:00 1 /tmp/\xff\n\
            VmFlags: rd hg\n\
            7f0000000000-7f0000001000 rw-p 00000000 fe:00 2 /tmp/x [heap]\n\
            VmFlags: rd wr hg\n"
            .to_vec();
        tricky.extend_from_slice(smaps("rd wr").as_bytes());
        assert_eq!(asks(&tricky), Some(false));
        assert_eq!(
            asks(b"7f80f4000000-7f80f8000000 rw-p 00000000 00:00 0\nVmFlags: hg\n"),
            None
        );
        assert_eq!(asks(b""), None);
    }

    /// What a start does after `restarts` restarts with `tunables`, where
    /// glibc's ask reads as `malloc_asks`: `Ok` with the tunables to start
    /// again with, or the outcome's name.
    fn next(
        restarts: u32,
        tunables: Option<&str>,
        malloc_asks: Option<bool>,
    ) -> Result<String, String> {
        super::next_start(
            restarts,
            "always [madvise] never\n",
            tunables.map(OsStr::new),
            || malloc_asks,
        )
        .map(|tunables| tunables.into_string().unwrap())
        .map_err(|outcome| format!("{outcome:?}"))
    }

    #[test]
    fn a_restart_starts_again_while_glibc_did_not_take_the_ask_and_no_more_than_the_bound() {
        let ask = "glibc.x=1:glibc.malloc.hugetlb=1";
        assert_eq!(next(0, Some("glibc.x=1"), None).as_deref(), Ok(ask));
        assert_eq!(next(1, Some(ask), Some(false)).as_deref(), Ok(ask));
        let most = super::MOST_RESTARTS;
        assert_eq!(next(most - 1, Some(ask), Some(false)).as_deref(), Ok(ask));
        assert_eq!(
            next(most, Some(ask), Some(false)),
            Err(format!("NotTaken {{ restarts: {most} }}"))
        );
        assert_eq!(
            next(3, Some(ask), Some(true)),
            Err("Asking { restarts: 3 }".into())
        );
        assert_eq!(
            next(3, Some(ask), None),
            Err("Unchecked { restarts: 3 }".into()),
            "no /proc: no start is spent on what cannot be told"
        );
    }

    #[test]
    fn a_start_checks_and_repeats_only_the_ask_kvgate_made() {
        // The first start does not read glibc's ask: nothing was asked yet.
        let untold = super::next_start(0, "always [madvise] never\n", None, || {
            panic!("read in the first start")
        });
        assert!(untold.is_ok());
        // A user's own value, with a count of restarts beside it.
        assert_eq!(
            next(2, Some("glibc.malloc.hugetlb=0"), Some(false)),
            Err("NothingToAsk".into())
        );
        assert_eq!(next(2, None, Some(false)), Err("NothingToAsk".into()));
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

    #[test]
    fn the_tunables_value_is_read_wherever_it_stands() {
        fn value(tunables: &str) -> Option<&[u8]> {
            super::huge_page_tunable(Some(OsStr::new(tunables)))
        }
        assert_eq!(value("glibc.malloc.hugetlb=1"), Some(&b"1"[..]));
        assert_eq!(value("a=1:glibc.malloc.hugetlb=0:b=2"), Some(&b"0"[..]));
        assert_eq!(
            value("glibc.malloc.hugetlb=1:glibc.malloc.hugetlb=0"),
            Some(&b"0"[..]),
            "the last, as glibc takes it"
        );
        assert_eq!(value("glibc.malloc.hugetlbx=1"), None);
        assert_eq!(value("glibc.malloc.hugetlb"), None, "no value: not set");
        assert_eq!(super::huge_page_tunable(None), None);
    }
}
