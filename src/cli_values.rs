//! Value parsers of the command line: sizes with units (`2MiB`), listen
//! addresses by host name (`localhost:50061`), and gRPC targets checked for
//! scheme, host and port. Each refuses a bad value at start, so clap names
//! the flag (or the environment variable) the user set.

use std::net::{SocketAddr, ToSocketAddrs};
use std::ops::RangeInclusive;

use clap::builder::TypedValueParser;

/// A value parser of byte counts written as plain bytes (`1048576`) or
/// with a unit (see [`parse_byte_size`]), within `range`.
pub fn byte_size(range: RangeInclusive<u64>) -> impl TypedValueParser<Value = u64> {
    clap::builder::StringValueParser::new().try_map(move |text| {
        let bytes = parse_byte_size(&text)?;
        if range.contains(&bytes) {
            Ok(bytes)
        } else {
            Err(format!(
                "{bytes} bytes is not in {}..={}",
                format_byte_size(*range.start()),
                format_byte_size(*range.end()),
            ))
        }
    })
}

/// A size in bytes as the documents write it: `2MiB`, `256MiB`, `4096`;
/// units in any case. Binary, 1024-based: `KiB MiB GiB TiB` and
/// Kubernetes' `Ki Mi Gi Ti`; decimal, 1000-based: `kB MB GB TB` and
/// Kubernetes' `k M G T` (so `2mb` is 2,000,000 bytes, `2Mi` 2,097,152).
/// A bare lower-case `m` is refused: Kubernetes reads it as milli.
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 2MiB, 256MiB)"))?;
    let unit = unit.trim();
    if unit == "m" {
        return Err(format!(
            "{text:?}: a bare m is milli in Kubernetes; write M or MB (10^6 bytes) or Mi or MiB (2^20)"
        ));
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" | "ki" => 1 << 10,
        "mib" | "mi" => 1 << 20,
        "gib" | "gi" => 1 << 30,
        "tib" | "ti" => 1 << 40,
        "kb" | "k" => 1_000,
        "mb" | "m" => 1_000_000,
        "gb" | "g" => 1_000_000_000,
        "tb" | "t" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown unit {unit:?} in {text:?} (use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB, in any case)"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is more bytes than fit in 64 bits"))
}

/// A size for humans: the largest binary unit that divides it exactly.
pub fn format_byte_size(bytes: u64) -> String {
    for (unit, size) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if bytes >= size && bytes.is_multiple_of(size) {
            return format!("{}{unit}", bytes / size);
        }
    }
    bytes.to_string()
}

/// A listen address: `IP:PORT`, or `HOST:PORT` resolved now (the first
/// address the name resolves to, as a server binds one socket).
pub fn parse_listen_address(text: &str) -> Result<SocketAddr, String> {
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let (host, port) = text.rsplit_once(':').ok_or_else(|| {
        format!("expected HOST:PORT (e.g. 0.0.0.0:50061, localhost:50061), got {text:?}")
    })?;
    if host.is_empty() {
        return Err(format!("missing host in {text:?} (e.g. 0.0.0.0{text})"));
    }
    let _: u16 = port
        .parse()
        .map_err(|_| format!("bad port {port:?} in {text:?}"))?;
    text.to_socket_addrs()
        .map_err(|error| format!("cannot resolve {host:?}: {error}"))?
        .next()
        .ok_or_else(|| format!("{host:?} resolves to no address"))
}

/// An `http://HOST:PORT` URL, optionally with a path prefix (the engine's
/// HTTP server).
pub fn parse_http_url(text: &str) -> Result<String, String> {
    let uri: http::Uri = text
        .parse()
        .map_err(|error| format!("expected http://HOST:PORT, got {text:?}: {error}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("expected http://HOST:PORT, got {text:?}"));
    }
    match uri.authority() {
        Some(authority) if !authority.host().is_empty() => Ok(text.to_owned()),
        _ => Err(format!("missing host in {text:?}")),
    }
}

/// A gRPC target `http://HOST:PORT` or `https://HOST:PORT`, kept as written.
pub fn parse_grpc_uri(text: &str) -> Result<String, String> {
    let uri: http::Uri = text
        .parse()
        .map_err(|error| format!("expected http://HOST:PORT, got {text:?}: {error}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(format!(
                "scheme {other:?} in {text:?}: use http:// or https://"
            ));
        }
        None => return Err(format!("missing scheme in {text:?}: write http://{text}")),
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("missing host in {text:?}"))?;
    if authority.host().is_empty() {
        return Err(format!("missing host in {text:?}"));
    }
    if authority.port_u16().is_none() {
        return Err(format!(
            "missing :PORT in {text:?} (e.g. http://127.0.0.1:50051)"
        ));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(format!(
            "{text:?} has a path; give only scheme, host and port"
        ));
    }
    Ok(text.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_accept_plain_bytes_binary_and_decimal_units() {
        for (text, bytes) in [
            ("4096", 4096),
            ("2MiB", 2 << 20),
            ("256MiB", 256 << 20),
            ("256Mi", 256 << 20),
            ("1GiB", 1 << 30),
            ("64KiB", 64 << 10),
            ("10MB", 10_000_000),
            ("512B", 512),
            ("2mb", 2_000_000),
            ("2MB", 2_000_000),
            ("2M", 2_000_000),
            ("2mib", 2 << 20),
            ("2MI", 2 << 20),
            ("64kb", 64_000),
            ("64k", 64_000),
            ("1gi", 1 << 30),
        ] {
            assert_eq!(parse_byte_size(text), Ok(bytes), "{text}");
        }
    }

    #[test]
    fn a_size_with_an_unknown_unit_or_no_number_is_refused_saying_why() {
        assert!(
            parse_byte_size("2 lightyears")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_byte_size("MiB").unwrap_err().contains("not a size"));
        assert!(parse_byte_size("2m").unwrap_err().contains("milli"));
        assert!(parse_byte_size("-1").unwrap_err().contains("not a size"));
        assert!(
            parse_byte_size("99999999999TiB")
                .unwrap_err()
                .contains("64 bits")
        );
    }

    #[test]
    fn sizes_are_shown_in_the_largest_exact_binary_unit() {
        assert_eq!(format_byte_size(256 << 20), "256MiB");
        assert_eq!(format_byte_size(3 << 20), "3MiB");
        assert_eq!(format_byte_size(4096), "4KiB");
        assert_eq!(format_byte_size(1000), "1000");
    }

    #[test]
    fn listen_addresses_accept_ips_and_host_names() {
        assert_eq!(
            parse_listen_address("0.0.0.0:50061").unwrap(),
            "0.0.0.0:50061".parse().unwrap()
        );
        assert!(
            parse_listen_address("localhost:0")
                .unwrap()
                .ip()
                .is_loopback()
        );
        assert!(
            parse_listen_address("nowhere")
                .unwrap_err()
                .contains("HOST:PORT")
        );
        assert!(
            parse_listen_address(":80")
                .unwrap_err()
                .contains("missing host")
        );
        assert!(
            parse_listen_address("localhost:http")
                .unwrap_err()
                .contains("bad port")
        );
    }

    #[test]
    fn grpc_targets_need_an_http_scheme_a_host_and_a_port() {
        assert!(parse_grpc_uri("http://127.0.0.1:50051").is_ok());
        assert!(parse_grpc_uri("https://engine.svc:443").is_ok());
        assert!(
            parse_grpc_uri("127.0.0.1:50051")
                .unwrap_err()
                .contains("scheme")
        );
        assert!(
            parse_grpc_uri("tcp://127.0.0.1:50051")
                .unwrap_err()
                .contains("scheme")
        );
        assert!(
            parse_grpc_uri("http://engine")
                .unwrap_err()
                .contains(":PORT")
        );
        assert!(
            parse_grpc_uri("http://engine:1/v1")
                .unwrap_err()
                .contains("path")
        );
    }
}
