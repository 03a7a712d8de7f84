//! The open-file limit, checked against the connection limits at start.
//!
//! Invariant: once kvgate is serving, the process may hold every allowed
//! connection of both ports and still have file descriptors for everything
//! else (engine sockets, the pass-through connection, logs), so a flood of
//! connections on either port never starves `/metrics`, the engine or a new
//! subscriber of a descriptor.

/// Descriptors kept for everything but client connections on the gRPC and
/// admin ports and the engine sockets of each rank.
const RESERVED: u64 = 128;

/// Engine sockets a data-parallel rank may hold: the KV-event SUB, the
/// replay DEALER and the load SUB (`--zmq-load-endpoint`). Counted whether
/// or not load push is on: a spare descriptor a rank costs less than
/// telling this module which sockets the sources open.
const SOCKETS_PER_RANK: u64 = 3;

/// The process may not open enough files for the connection limit.
#[derive(Debug, thiserror::Error)]
#[error(
    "needs about {needed} open files (one a connection on either port, {RESERVED} more \
     for kvgate itself, {SOCKETS_PER_RANK} per rank), \
     but the limit is {soft} (ulimit -n; hard limit {hard}): lower it or raise the limit"
)]
pub struct TooFewFiles {
    needed: u64,
    soft: u64,
    hard: u64,
}

/// Raises the soft open-file limit as far as needed for `max_connections`
/// on the gRPC port and `admin_connections` on the admin port (up to the
/// hard limit), or says how far short the system falls.
pub fn ensure_room_for(
    max_connections: u32,
    admin_connections: u32,
    dp_size: u32,
) -> Result<(), TooFewFiles> {
    let needed = u64::from(max_connections)
        + u64::from(admin_connections)
        + SOCKETS_PER_RANK * u64::from(dp_size)
        + RESERVED;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        // Without a known limit there is nothing to check against.
        return Ok(());
    }
    if limit.rlim_cur >= needed {
        return Ok(());
    }
    if limit.rlim_max >= needed {
        let raised = libc::rlimit {
            rlim_cur: needed,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return Ok(());
        }
    }
    Err(TooFewFiles {
        needed,
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
    })
}
