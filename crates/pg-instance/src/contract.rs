//! What the instance manager and the database-operator agree on: names, labels, the Lease
//! and the status each instance publishes on its pod. They talk only through the
//! Kubernetes API.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Label on every pod of a cluster: the cluster's name.
pub const CLUSTER_LABEL: &str = "database.steward.dev/cluster";
/// Label on each pod: [`PRIMARY`] or [`REPLICA`]. The `-rw` Service selects the primary by
/// it; the instance that wins the Lease moves it as part of its promotion.
pub const ROLE_LABEL: &str = "database.steward.dev/role";
pub const PRIMARY: &str = "primary";
pub const REPLICA: &str = "replica";
/// Annotation on each pod: its instance's [`InstanceStatus`] as JSON, written by its
/// instance manager when its role, timeline or position changed.
pub const STATUS_ANNOTATION: &str = "database.steward.dev/instance";
/// Annotation on the Lease: the instance the primary should hand over to (a planned
/// switchover, set by the operator for a rolling update or on request). The primary shuts
/// down cleanly and releases the Lease; only that instance may take it; it clears the
/// annotation once it leads.
pub const TARGET_ANNOTATION: &str = "database.steward.dev/target-primary";
/// The role streaming replicas (and `pg_rewind`) connect as; never the superuser.
pub const REPLICATION_USER: &str = "steward_replication";
/// The instance manager's binary, in the operator's image and copied into each pod.
pub const BINARY: &str = "steward-pg-instance";
/// Port of the instance manager's `/healthz`, `/readyz` and `/status`.
pub const HTTP_PORT: u16 = 8008;
/// PostgreSQL's port.
pub const PG_PORT: u16 = 5432;

/// The Lease whose holder is the cluster's primary: only its holder may accept writes.
pub fn lease_name(cluster: &str) -> String {
    format!("{cluster}-primary")
}

/// What an instance is doing, as it reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Role {
    /// Accepting writes (holds the Lease).
    Primary,
    /// Streaming (or trying to stream) from the primary.
    Replica,
    /// Not running PostgreSQL: initializing, cloning, rewinding, fenced or stopped.
    Down,
}

/// One instance's status, published on its pod ([`STATUS_ANNOTATION`]) for the other
/// instances (which one is most advanced) and the operator (the cluster's status).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceStatus {
    pub role: Role,
    /// The timeline PostgreSQL runs on (0: unknown).
    pub timeline: u32,
    /// The primary's current write position, or what a replica has received (the larger of
    /// received and replayed).
    pub lsn: Lsn,
    /// Bytes a replica has received but not yet replayed.
    #[serde(default)]
    pub replay_lag: u64,
}

/// A WAL position, written as PostgreSQL writes it (`16/B374D848`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// A string that is not `HEX/HEX`.
#[derive(Debug, thiserror::Error)]
#[error("not an LSN: {0:?}")]
pub struct BadLsn(String);

impl FromStr for Lsn {
    type Err = BadLsn;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadLsn(s.to_string());
        let (hi, lo) = s.split_once('/').ok_or_else(bad)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| bad())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| bad())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Lsn {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Whether `pod`'s `Ready` condition is true (the kubelet's probes pass).
pub fn pod_ready(pod: &k8s_openapi::api::core::v1::Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The ordinal of a StatefulSet pod (`pg-2` → 2).
pub fn ordinal(pod: &str) -> Option<u32> {
    pod.rsplit_once('-')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_as_postgresql_writes_it() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn(0));
        assert!("0/3000060".parse::<Lsn>().unwrap() > "0/30000".parse().unwrap());
        assert!("16".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
    }

    #[test]
    fn status_is_camel_case_json_with_the_lsn_as_text() {
        let status = InstanceStatus {
            role: Role::Replica,
            timeline: 2,
            lsn: Lsn(0x3000060),
            replay_lag: 0,
        };
        let json = serde_json::to_string(&status).unwrap();
        assert_eq!(
            json,
            r#"{"role":"replica","timeline":2,"lsn":"0/3000060","replayLag":0}"#
        );
        assert_eq!(
            serde_json::from_str::<InstanceStatus>(&json).unwrap(),
            status
        );
    }

    #[test]
    fn ordinals_and_lease_names() {
        assert_eq!(ordinal("pg-2"), Some(2));
        assert_eq!(ordinal("my-db-10"), Some(10));
        assert_eq!(ordinal("pg"), None);
        assert_eq!(lease_name("pg"), "pg-primary");
    }
}
