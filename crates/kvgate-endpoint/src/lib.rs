//! The engines' ZMQ endpoint convention, shared by kvgate's sources and the
//! simulated engine: where each data-parallel rank's publisher is, and which
//! side binds.
//!
//! Engines offset their ports per rank (rank r listens on base port + r) and
//! bind when given a wildcard host; kvgate then connects to loopback. When the
//! engine is configured with a concrete host it connects out, and kvgate must
//! bind instead (`--zmq-bind`). With multi-node data parallelism the ranks
//! live on different hosts with ports of their own: then every rank's
//! endpoint is named, in rank order.
//!
//! An engine on the same host may publish on a Unix-domain socket instead
//! (`ipc://PATH`). A path has no port to offset, so with more than one rank
//! every rank's `ipc://` endpoint is named. Invariant: an [`IpcEndpoint`]
//! holds a path a socket address can carry (not empty, not abstract, no
//! NUL, at most [`IpcEndpoint::MAX_PATH_BYTES`] bytes), so dialling or
//! binding it fails only for what is (or is not) at the path.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

/// A `tcp://HOST:PORT` endpoint as configured on the engine side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEndpoint {
    host: String,
    port: u16,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    #[error("expected tcp://HOST:PORT, got {0:?}")]
    NotTcp(String),
    #[error("expected tcp://HOST:PORT or ipc://PATH, got {0:?}")]
    UnknownScheme(String),
    #[error(
        "{0:?} is an inproc:// endpoint, which only threads of the engine's own process can reach: \
         publish on tcp://HOST:PORT or ipc://PATH"
    )]
    Inproc(String),
    #[error("missing :PORT in {0:?}")]
    MissingPort(String),
    #[error("bad port in {0:?}")]
    BadPort(String),
    #[error("{0:?} names no path: expected ipc://PATH")]
    EmptyIpcPath(String),
    #[error(
        "{0:?} names an abstract socket (ipc://@NAME), which kvgate does not dial: give a path"
    )]
    AbstractIpc(String),
    #[error("{0:?} has a NUL byte in its path")]
    NulInIpcPath(String),
    #[error("{0:?} asks for a path chosen at bind (ipc://*), which cannot be dialled: give a path")]
    WildcardIpc(String),
    #[error(
        "the path of {endpoint:?} is {bytes} bytes; a Unix socket address holds at most {max}: \
         use a shorter path"
    )]
    IpcPathTooLong {
        endpoint: String,
        bytes: usize,
        max: usize,
    },
    #[error("rank {rank} has no endpoint ({listed} listed)")]
    NoSuchRank { rank: u32, listed: usize },
    #[error("rank {rank} of {endpoint} would use port {port}, beyond 65535")]
    PortOverflow {
        endpoint: String,
        rank: u32,
        port: u32,
    },
}

impl FromStr for TcpEndpoint {
    type Err = EndpointError;

    fn from_str(uri: &str) -> Result<Self, Self::Err> {
        let rest = uri
            .strip_prefix("tcp://")
            .ok_or_else(|| EndpointError::NotTcp(uri.to_owned()))?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| EndpointError::MissingPort(uri.to_owned()))?;
        let port = port
            .parse()
            .map_err(|_| EndpointError::BadPort(uri.to_owned()))?;
        if host.is_empty() {
            return Err(EndpointError::NotTcp(uri.to_owned()));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for TcpEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tcp://{}:{}", self.host, self.port)
    }
}

impl TcpEndpoint {
    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn host(&self) -> &str {
        &self.host
    }

    /// True for the hosts engines treat as "bind on every interface".
    pub fn is_wildcard(&self) -> bool {
        matches!(self.host.as_str(), "*" | "0.0.0.0" | "::" | "[::]")
    }

    /// The endpoint of rank `rank`: same host, port + rank.
    pub fn for_rank(&self, rank: u32) -> Result<Self, EndpointError> {
        let port = u32::from(self.port) + rank;
        let port = u16::try_from(port).map_err(|_| EndpointError::PortOverflow {
            endpoint: self.to_string(),
            rank,
            port,
        })?;
        Ok(Self {
            host: self.host.clone(),
            port,
        })
    }

    /// The address a subscriber connects to: a wildcard means "this host".
    pub fn connect_address(&self) -> String {
        if self.is_wildcard() {
            format!("tcp://127.0.0.1:{}", self.port)
        } else {
            self.to_string()
        }
    }

    /// The address kvgate binds when the engine connects out to it.
    pub fn bind_address(&self) -> String {
        let host = if self.host == "*" {
            "0.0.0.0"
        } else {
            &self.host
        };
        format!("tcp://{host}:{}", self.port)
    }
}

/// A Unix-domain socket endpoint, `ipc://PATH` (see the module's invariant).
/// A relative path is taken from kvgate's working directory, as libzmq does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcEndpoint {
    path: String,
}

impl IpcEndpoint {
    /// The longest path `sun_path` (108 bytes on Linux) holds with its
    /// terminating NUL.
    pub const MAX_PATH_BYTES: usize = 107;

    /// Where the socket file is.
    pub fn path(&self) -> &Path {
        Path::new(&self.path)
    }
}

impl FromStr for IpcEndpoint {
    type Err = EndpointError;

    fn from_str(uri: &str) -> Result<Self, Self::Err> {
        let path = uri
            .strip_prefix("ipc://")
            .ok_or_else(|| EndpointError::UnknownScheme(uri.to_owned()))?;
        if path.is_empty() {
            return Err(EndpointError::EmptyIpcPath(uri.to_owned()));
        }
        if path.starts_with('@') {
            return Err(EndpointError::AbstractIpc(uri.to_owned()));
        }
        if path == "*" {
            return Err(EndpointError::WildcardIpc(uri.to_owned()));
        }
        if path.contains('\0') {
            return Err(EndpointError::NulInIpcPath(uri.to_owned()));
        }
        if path.len() > Self::MAX_PATH_BYTES {
            return Err(EndpointError::IpcPathTooLong {
                endpoint: uri.to_owned(),
                bytes: path.len(),
                max: Self::MAX_PATH_BYTES,
            });
        }
        Ok(Self {
            path: path.to_owned(),
        })
    }
}

impl fmt::Display for IpcEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ipc://{}", self.path)
    }
}

/// A ZMQ endpoint kvgate can reach: a TCP host and port, or a Unix-domain
/// socket on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZmqEndpoint {
    Tcp(TcpEndpoint),
    Ipc(IpcEndpoint),
}

impl FromStr for ZmqEndpoint {
    type Err = EndpointError;

    fn from_str(uri: &str) -> Result<Self, Self::Err> {
        if uri.starts_with("tcp://") {
            uri.parse().map(Self::Tcp)
        } else if uri.starts_with("ipc://") {
            uri.parse().map(Self::Ipc)
        } else if uri.starts_with("inproc://") {
            Err(EndpointError::Inproc(uri.to_owned()))
        } else {
            Err(EndpointError::UnknownScheme(uri.to_owned()))
        }
    }
}

impl fmt::Display for ZmqEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(tcp) => tcp.fmt(f),
            Self::Ipc(ipc) => ipc.fmt(f),
        }
    }
}

impl From<TcpEndpoint> for ZmqEndpoint {
    fn from(tcp: TcpEndpoint) -> Self {
        Self::Tcp(tcp)
    }
}

impl ZmqEndpoint {
    /// The address a subscriber connects to (a wildcard TCP host means
    /// "this host").
    pub fn connect_address(&self) -> String {
        match self {
            Self::Tcp(tcp) => tcp.connect_address(),
            Self::Ipc(ipc) => ipc.to_string(),
        }
    }

    /// The address kvgate binds when the engine connects out to it.
    pub fn bind_address(&self) -> String {
        match self {
            Self::Tcp(tcp) => tcp.bind_address(),
            Self::Ipc(ipc) => ipc.to_string(),
        }
    }
}

/// Where every rank's publisher (or replay endpoint) is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankEndpoints {
    /// Rank 0's endpoint; rank r at its port + r.
    Offset(TcpEndpoint),
    /// Each rank's own endpoint, index = rank.
    Listed(Vec<ZmqEndpoint>),
}

/// Why the endpoints a flag was given name no endpoint for each rank.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RankEndpointsError {
    #[error(
        "{flag} is given {given} times but --dp-size is {dp_size}: give it once (rank r at port + r) or once per rank, in rank order"
    )]
    CountMismatch {
        flag: &'static str,
        given: usize,
        dp_size: u32,
    },
    #[error(
        "{flag} {endpoint} is given once but --dp-size is {dp_size}: an ipc:// path has no port to offset per rank; give one endpoint per rank, in rank order"
    )]
    IpcOffset {
        flag: &'static str,
        endpoint: IpcEndpoint,
        dp_size: u32,
    },
}

impl RankEndpoints {
    /// The endpoints `flag` was given, for `dp_size` ranks: none, one (the
    /// base-port rule for `tcp://`; an `ipc://` one serves a single rank)
    /// or exactly one per rank.
    pub fn from_flag(
        flag: &'static str,
        given: &[ZmqEndpoint],
        dp_size: u32,
    ) -> Result<Option<Self>, RankEndpointsError> {
        match given {
            [] => Ok(None),
            [ZmqEndpoint::Tcp(base)] => Ok(Some(Self::Offset(base.clone()))),
            [ZmqEndpoint::Ipc(endpoint)] if dp_size > 1 => Err(RankEndpointsError::IpcOffset {
                flag,
                endpoint: endpoint.clone(),
                dp_size,
            }),
            listed if listed.len() == dp_size as usize => Ok(Some(Self::Listed(listed.to_vec()))),
            listed => Err(RankEndpointsError::CountMismatch {
                flag,
                given: listed.len(),
                dp_size,
            }),
        }
    }

    /// Rank `rank`'s endpoint.
    pub fn for_rank(&self, rank: u32) -> Result<ZmqEndpoint, EndpointError> {
        match self {
            Self::Offset(base) => base.for_rank(rank).map(ZmqEndpoint::Tcp),
            Self::Listed(listed) => {
                listed
                    .get(rank as usize)
                    .cloned()
                    .ok_or(EndpointError::NoSuchRank {
                        rank,
                        listed: listed.len(),
                    })
            }
        }
    }
}

/// A single rank's endpoint.
impl From<ZmqEndpoint> for RankEndpoints {
    fn from(endpoint: ZmqEndpoint) -> Self {
        Self::Listed(vec![endpoint])
    }
}

impl fmt::Display for RankEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Offset(base) => write!(f, "{base}"),
            Self::Listed(listed) => {
                let names: Vec<String> = listed.iter().map(ToString::to_string).collect();
                write!(f, "{}", names.join(" "))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_r_listens_on_base_port_plus_r() {
        let base: TcpEndpoint = "tcp://*:5557".parse().unwrap();
        assert_eq!(base.for_rank(0).unwrap().port(), 5557);
        assert_eq!(base.for_rank(3).unwrap().port(), 5560);
    }

    #[test]
    fn a_wildcard_engine_endpoint_is_reached_on_loopback() {
        for uri in ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"] {
            let endpoint: TcpEndpoint = uri.parse().unwrap();
            assert_eq!(endpoint.connect_address(), "tcp://127.0.0.1:5557");
        }
        let concrete: TcpEndpoint = "tcp://10.0.0.7:5557".parse().unwrap();
        assert_eq!(concrete.connect_address(), "tcp://10.0.0.7:5557");
    }

    #[test]
    fn binding_a_star_endpoint_binds_every_interface() {
        let endpoint: TcpEndpoint = "tcp://*:6000".parse().unwrap();
        assert_eq!(endpoint.bind_address(), "tcp://0.0.0.0:6000");
    }

    #[test]
    fn malformed_endpoints_are_refused_with_the_reason() {
        assert!(matches!(
            "ipc:///tmp/x".parse::<TcpEndpoint>(),
            Err(EndpointError::NotTcp(_))
        ));
        assert!(matches!(
            "tcp://host".parse::<TcpEndpoint>(),
            Err(EndpointError::MissingPort(_))
        ));
        assert!(matches!(
            "tcp://host:99999".parse::<TcpEndpoint>(),
            Err(EndpointError::BadPort(_))
        ));
        let top: TcpEndpoint = "tcp://*:65535".parse().unwrap();
        assert!(matches!(
            top.for_rank(1),
            Err(EndpointError::PortOverflow { .. })
        ));
    }

    fn endpoints(uris: &[&str]) -> Vec<ZmqEndpoint> {
        uris.iter().map(|uri| uri.parse().unwrap()).collect()
    }

    #[test]
    fn one_endpoint_per_rank_names_each_ranks_own_host_and_port() {
        let listed = endpoints(&["tcp://10.0.0.1:7000", "tcp://10.0.0.2:5123"]);
        let ranks = RankEndpoints::from_flag("--zmq-endpoint", &listed, 2)
            .unwrap()
            .unwrap();
        assert_eq!(
            ranks.for_rank(1).unwrap().to_string(),
            "tcp://10.0.0.2:5123"
        );
        assert_eq!(
            ranks.for_rank(2),
            Err(EndpointError::NoSuchRank { rank: 2, listed: 2 })
        );
        let once = RankEndpoints::from_flag("--zmq-endpoint", &listed[..1], 4)
            .unwrap()
            .unwrap();
        assert_eq!(
            once.for_rank(3).unwrap().to_string(),
            "tcp://10.0.0.1:7003",
            "given once: base port + r"
        );
    }

    #[test]
    fn a_count_of_endpoints_that_is_not_the_dp_size_is_refused_naming_both() {
        let listed = endpoints(&["tcp://a:1", "tcp://b:2"]);
        let refused = RankEndpoints::from_flag("--zmq-replay-endpoint", &listed, 3).unwrap_err();
        let message = refused.to_string();
        assert!(
            message.contains("--zmq-replay-endpoint is given 2 times"),
            "{message}"
        );
        assert!(message.contains("--dp-size is 3"), "{message}");
        assert_eq!(RankEndpoints::from_flag("--zmq-endpoint", &[], 3), Ok(None));
    }

    #[test]
    fn an_ipc_endpoint_is_dialled_and_bound_at_its_path() {
        let endpoint: ZmqEndpoint = "ipc:///run/vllm/kv-0.sock".parse().unwrap();
        assert_eq!(endpoint.connect_address(), "ipc:///run/vllm/kv-0.sock");
        assert_eq!(endpoint.bind_address(), "ipc:///run/vllm/kv-0.sock");
        let ZmqEndpoint::Ipc(ipc) = &endpoint else {
            panic!("{endpoint:?} is not ipc");
        };
        assert_eq!(ipc.path(), Path::new("/run/vllm/kv-0.sock"));
        let relative: ZmqEndpoint = "ipc://kv.sock".parse().unwrap();
        assert_eq!(relative.to_string(), "ipc://kv.sock");
        let tcp: ZmqEndpoint = "tcp://*:5557".parse().unwrap();
        assert_eq!(tcp.connect_address(), "tcp://127.0.0.1:5557");
    }

    #[test]
    fn an_ipc_path_a_socket_address_cannot_hold_is_refused_with_its_length() {
        let longest = format!("ipc:///{}", "a".repeat(IpcEndpoint::MAX_PATH_BYTES - 1));
        assert!(longest.parse::<ZmqEndpoint>().is_ok());
        let too_long = format!("ipc:///{}", "a".repeat(IpcEndpoint::MAX_PATH_BYTES));
        let refused = too_long.parse::<ZmqEndpoint>().unwrap_err();
        assert_eq!(
            refused,
            EndpointError::IpcPathTooLong {
                endpoint: too_long,
                bytes: 108,
                max: 107
            }
        );
        assert!(refused.to_string().contains("is 108 bytes"), "{refused}");
        for (uri, expected) in [
            ("ipc://", EndpointError::EmptyIpcPath("ipc://".into())),
            ("ipc://@kv", EndpointError::AbstractIpc("ipc://@kv".into())),
            ("ipc://*", EndpointError::WildcardIpc("ipc://*".into())),
            (
                "ipc:///a\0b",
                EndpointError::NulInIpcPath("ipc:///a\0b".into()),
            ),
        ] {
            assert_eq!(uri.parse::<ZmqEndpoint>(), Err(expected));
        }
    }

    #[test]
    fn inproc_and_unknown_schemes_are_refused_with_what_is_reachable() {
        let inproc = "inproc://kv".parse::<ZmqEndpoint>().unwrap_err();
        assert_eq!(inproc, EndpointError::Inproc("inproc://kv".into()));
        assert!(inproc.to_string().contains("ipc://PATH"), "{inproc}");
        assert_eq!(
            "udp://h:1".parse::<ZmqEndpoint>(),
            Err(EndpointError::UnknownScheme("udp://h:1".into()))
        );
        assert_eq!(
            "tcp://h".parse::<ZmqEndpoint>(),
            Err(EndpointError::MissingPort("tcp://h".into()))
        );
    }

    #[test]
    fn one_ipc_endpoint_serves_one_rank_and_several_ranks_need_one_each() {
        let ipc = endpoints(&["ipc:///tmp/kv-0.sock"]);
        let single = RankEndpoints::from_flag("--zmq-endpoint", &ipc, 1)
            .unwrap()
            .unwrap();
        assert_eq!(
            single.for_rank(0).unwrap().to_string(),
            "ipc:///tmp/kv-0.sock"
        );
        let refused = RankEndpoints::from_flag("--zmq-endpoint", &ipc, 2).unwrap_err();
        let message = refused.to_string();
        assert!(
            message.starts_with(
                "--zmq-endpoint ipc:///tmp/kv-0.sock is given once but --dp-size is 2"
            ),
            "{message}"
        );
        let per_rank = endpoints(&["ipc:///tmp/kv-0.sock", "tcp://10.0.0.2:5557"]);
        let mixed = RankEndpoints::from_flag("--zmq-endpoint", &per_rank, 2)
            .unwrap()
            .unwrap();
        assert_eq!(
            mixed.for_rank(1).unwrap().to_string(),
            "tcp://10.0.0.2:5557"
        );
    }
}
