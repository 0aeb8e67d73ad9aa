//! Command-line flags every Steward operator binary shares.
//!
//! ```no_run
//! #[derive(clap::Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     common: steward_core::cli::CommonArgs,
//! }
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::Error;

/// Flags shared by every operator (names as controller-runtime's where they exist).
#[derive(Args, Clone, Debug)]
pub struct CommonArgs {
    /// Path to a kubeconfig; in-cluster configuration when unset (KUBECONFIG also works).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Elect a leader so only one replica reconciles.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub leader_elect: bool,

    /// Namespace of the leader election Lease (default: the pod's namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_election_namespace: Option<String>,

    /// Name of the leader election Lease (default: the operator's name).
    #[arg(long)]
    pub leader_election_id: Option<String>,

    /// How long a non-renewed Lease stays valid.
    #[arg(long, default_value = "15s", value_parser = parse_duration)]
    pub leader_election_lease_duration: Duration,

    /// How long the leader keeps trying to renew before it stops leading.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub leader_election_renew_deadline: Duration,

    /// How often candidates retry.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub leader_election_retry_period: Duration,

    /// Spread the objects of sharded controllers over this many shards, each held by one
    /// replica through a Lease of its own (`<lease>-shard-<i>`); needs leader election. `1`
    /// (the default): one leader reconciles everything. See `steward_core::shard`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub shards: u32,

    /// Address of the Prometheus `/metrics` endpoint (`0` disables).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_bind_address: String,

    /// Address of `/healthz` and `/readyz` (`0` disables; may equal the metrics address).
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub health_probe_bind_address: String,

    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,

    /// Maximum concurrent reconciles per controller.
    #[arg(long, default_value_t = 8)]
    pub concurrency: u16,

    /// How long graceful shutdown takes at most: in-flight reconciles may finish until this
    /// minus the time kept for releasing the Lease (the renew deadline, at most half), then
    /// they are cancelled; the process exits within it. Keep it below the pod's
    /// terminationGracePeriodSeconds.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub shutdown_timeout: Duration,

    /// How long one reconcile may run before it is cancelled and retried with backoff (a
    /// `ReconcileTimedOut` warning Event says so): the bound on any call a reconcile makes
    /// that has none of its own (a server that accepts a connection and never answers).
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub reconcile_timeout: Duration,

    /// How long a leading controller may have queued work without starting a reconcile, or
    /// a watch may keep failing, before `/healthz` fails (so the kubelet restarts the pod).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub stall_timeout: Duration,

    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log filter, e.g. `info` or `info,kube=debug` (RUST_LOG also works and wins).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Export traces (one per reconcile, with its API requests) over OTLP/HTTP to this base
    /// URL, e.g. `http://otel-collector:4318` (`/v1/traces` is appended); off when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,
}

impl Default for CommonArgs {
    /// The defaults of every flag, as if the binary ran without arguments (tests set fields).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Defaults {
            #[command(flatten)]
            common: CommonArgs,
        }
        <Defaults as clap::Parser>::parse_from(["steward"]).common
    }
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
/// How log lines are written.
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl CommonArgs {
    /// A client from `--kubeconfig`, else the usual inference (KUBECONFIG, in-cluster).
    ///
    /// # Errors
    /// [`Error::Config`] when no configuration can be loaded.
    pub async fn client(&self) -> Result<kube::Client, Error> {
        kube::Client::try_from(self.config().await?).map_err(|e| Error::Config(e.to_string()))
    }

    /// The client configuration from `--kubeconfig`, else the usual inference.
    ///
    /// # Errors
    /// [`Error::Config`] when no configuration can be loaded.
    pub async fn config(&self) -> Result<kube::Config, Error> {
        Ok(match &self.kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path)
                    .map_err(|e| Error::Config(format!("kubeconfig {}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .map_err(|e| Error::Config(format!("kubeconfig {}: {e}", path.display())))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| Error::Config(e.to_string()))?,
        })
    }

    /// The metrics address, `None` if disabled.
    ///
    /// # Errors
    /// [`Error::Config`] for an unparsable address.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, Error> {
        parse_addr("--metrics-bind-address", &self.metrics_bind_address)
    }

    /// The probe address, `None` if disabled.
    ///
    /// # Errors
    /// [`Error::Config`] for an unparsable address.
    pub fn health_addr(&self) -> Result<Option<SocketAddr>, Error> {
        parse_addr(
            "--health-probe-bind-address",
            &self.health_probe_bind_address,
        )
    }
}

fn parse_addr(flag: &str, value: &str) -> Result<Option<SocketAddr>, Error> {
    if value == "0" || value.is_empty() {
        return Ok(None);
    }
    let value = if value.starts_with(':') {
        format!("0.0.0.0{value}")
    } else {
        value.to_string()
    };
    value
        .parse()
        .map(Some)
        .map_err(|e| Error::Config(format!("{flag} {value}: {e}")))
}

/// The value of every flag of `O` when none is given: what `Default` of an operator's
/// options should return, so the defaults live only in the flag definitions.
///
/// # Panics
/// If `O` has a required flag (it then has no default to give).
pub fn defaults<O: clap::Args + clap::FromArgMatches>() -> O {
    let command = O::augment_args(clap::Command::new("defaults"));
    let parsed = command
        .try_get_matches_from(["defaults"])
        .and_then(|matches| O::from_arg_matches(&matches));
    match parsed {
        Ok(options) => options,
        Err(e) => panic!("these options have a required flag, so no defaults: {e}"),
    }
}

/// The longest duration [`parse_duration`] accepts: 100 years, far beyond any timeout or
/// interval, and far below where arithmetic on `Instant`s or `Duration`s could overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// Parses `--otlp-endpoint`: an `http://` or `https://` base URL.
fn parse_otlp_endpoint(text: &str) -> Result<String, String> {
    traces_url(text).map(|_| text.to_string())
}

/// The OTLP/HTTP traces URL for a `--otlp-endpoint` base URL (`/v1/traces` appended, as the
/// OpenTelemetry specification says for `OTEL_EXPORTER_OTLP_ENDPOINT`).
///
/// # Errors
/// The reason, when `endpoint` is not an `http://` or `https://` URL.
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|e| format!("--otlp-endpoint {endpoint:?}: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => {}
        _ => {
            return Err(format!(
                "--otlp-endpoint {endpoint:?}: expected an http:// or https:// URL such as http://otel-collector:4318"
            ));
        }
    }
    Ok(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
}

/// Parses a duration in Go's syntax, as `kubectl` and CEL's `duration()` do: a sequence of
/// decimal numbers with a unit each (`1500ms`, `15s`, `2m`, `1h30m`, `1.5h`; units `ns`, `us`,
/// `µs`, `ms`, `s`, `m`, `h`), or plain seconds (`30`).
///
/// # Errors
/// A message naming the input for anything else, for a negative or non-finite value, and for
/// anything longer than [`MAX_DURATION`] (never a panic, whatever the input).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let input = s.trim();
    let invalid = || format!("invalid duration {input:?} (try 15s, 500ms, 2m, 1h30m)");
    if input.is_empty() {
        return Err(invalid());
    }
    if input.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return from_secs(input.parse::<f64>().map_err(|_| invalid())?, input);
    }
    let mut rest = input;
    let mut total = 0.0_f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(invalid)?;
        let (num, tail) = rest.split_at(num_len);
        let n: f64 = num.parse().map_err(|_| invalid())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => {
                return Err(format!(
                    "invalid duration unit {unit:?} in {input:?} (use ms, s, m or h)"
                ));
            }
        };
        total += n * scale;
        rest = tail;
    }
    from_secs(total, input)
}

fn from_secs(secs: f64, input: &str) -> Result<Duration, String> {
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {input:?}"));
    }
    if secs > MAX_DURATION.as_secs_f64() {
        return Err(format!(
            "duration {input:?} is too long (at most 100 years)"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("invalid duration {input:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Test {
        #[command(flatten)]
        common: CommonArgs,
    }

    #[test]
    fn defaults_match_client_go() {
        let t = Test::parse_from(["op"]);
        assert!(t.common.leader_elect);
        assert_eq!(
            t.common.leader_election_lease_duration,
            Duration::from_secs(15)
        );
        assert_eq!(
            t.common.leader_election_renew_deadline,
            Duration::from_secs(10)
        );
        assert_eq!(
            t.common.leader_election_retry_period,
            Duration::from_secs(2)
        );
        assert_eq!(
            t.common.metrics_addr().unwrap(),
            Some("0.0.0.0:8080".parse().unwrap())
        );
    }

    #[test]
    fn flags_parse() {
        let t = Test::parse_from([
            "op",
            "--leader-elect=false",
            "--leader-election-lease-duration=1500ms",
            "--metrics-bind-address=0",
            "--health-probe-bind-address=:9000",
            "--log-format=json",
            "--otlp-endpoint=http://otel-collector:4318",
        ]);
        assert!(!t.common.leader_elect);
        assert_eq!(
            t.common.leader_election_lease_duration,
            Duration::from_millis(1500)
        );
        assert_eq!(t.common.metrics_addr().unwrap(), None);
        assert_eq!(
            t.common.health_addr().unwrap(),
            Some("0.0.0.0:9000".parse().unwrap())
        );
        assert_eq!(t.common.log_format, LogFormat::Json);
        assert_eq!(
            t.common.otlp_endpoint.as_deref(),
            Some("http://otel-collector:4318")
        );
    }

    #[test]
    fn an_otlp_endpoint_that_is_not_a_url_is_a_usage_error() {
        let err = Test::try_parse_from(["op", "--otlp-endpoint=otel-collector:4318"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("--otlp-endpoint") && err.contains("http://"),
            "{err}"
        );
    }

    #[test]
    fn bad_durations_are_errors() {
        for bad in [
            "soon",
            "5y",
            "",
            "h",
            "1h30",
            "-5s",
            "1..5s",
            "99999999999999999999h",
            "1e400s",
            "876001h",
            "1s2",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
    }

    #[test]
    fn go_durations_parse() {
        for (text, want) in [
            ("1500ms", Duration::from_millis(1500)),
            ("30", Duration::from_secs(30)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5h", Duration::from_secs(5400)),
            ("2h45m10s", Duration::from_secs(9910)),
            ("250us", Duration::from_micros(250)),
            ("876000h", MAX_DURATION),
        ] {
            assert_eq!(parse_duration(text).unwrap(), want, "{text}");
        }
    }
}
