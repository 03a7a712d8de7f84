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

use std::fmt;
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
    #[error("missing :PORT in {0:?}")]
    MissingPort(String),
    #[error("bad port in {0:?}")]
    BadPort(String),
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

/// Where every rank's publisher (or replay endpoint) is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankEndpoints {
    /// Rank 0's endpoint; rank r at its port + r.
    Offset(TcpEndpoint),
    /// Each rank's own endpoint, index = rank.
    Listed(Vec<TcpEndpoint>),
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{flag} is given {given} times but --dp-size is {dp_size}: give it once (rank r at port + r) or once per rank, in rank order"
)]
pub struct RankCountMismatch {
    pub flag: &'static str,
    pub given: usize,
    pub dp_size: u32,
}

impl RankEndpoints {
    /// The endpoints `flag` was given, for `dp_size` ranks: none, one (the
    /// base-port rule) or exactly one per rank.
    pub fn from_flag(
        flag: &'static str,
        given: &[TcpEndpoint],
        dp_size: u32,
    ) -> Result<Option<Self>, RankCountMismatch> {
        match given {
            [] => Ok(None),
            [base] => Ok(Some(Self::Offset(base.clone()))),
            listed if listed.len() == dp_size as usize => Ok(Some(Self::Listed(listed.to_vec()))),
            listed => Err(RankCountMismatch {
                flag,
                given: listed.len(),
                dp_size,
            }),
        }
    }

    /// Rank `rank`'s endpoint.
    pub fn for_rank(&self, rank: u32) -> Result<TcpEndpoint, EndpointError> {
        match self {
            Self::Offset(base) => base.for_rank(rank),
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

    #[test]
    fn one_endpoint_per_rank_names_each_ranks_own_host_and_port() {
        let listed: Vec<TcpEndpoint> = ["tcp://10.0.0.1:7000", "tcp://10.0.0.2:5123"]
            .iter()
            .map(|uri| uri.parse().unwrap())
            .collect();
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
            once.for_rank(3).unwrap().port(),
            7003,
            "given once: base port + r"
        );
    }

    #[test]
    fn a_count_of_endpoints_that_is_not_the_dp_size_is_refused_naming_both() {
        let listed: Vec<TcpEndpoint> = ["tcp://a:1", "tcp://b:2"]
            .iter()
            .map(|uri| uri.parse().unwrap())
            .collect();
        let refused = RankEndpoints::from_flag("--zmq-replay-endpoint", &listed, 3).unwrap_err();
        let message = refused.to_string();
        assert!(
            message.contains("--zmq-replay-endpoint is given 2 times"),
            "{message}"
        );
        assert!(message.contains("--dp-size is 3"), "{message}");
        assert_eq!(RankEndpoints::from_flag("--zmq-endpoint", &[], 3), Ok(None));
    }
}
