//! `spec.replica`: a standby cluster (disaster recovery), as the operator sees it.
//!
//! How it works: the instance managers do the work. The operator hands them the source's
//! object store (`STEWARD_REPLICA_SOURCE_*`, [`super::build::backup_env`]) and the right to
//! read their own PostgresCluster; the leader (the holder of the Lease `<cluster>-primary`)
//! restores the source's newest base backup, replays the source's archived WAL as a standby
//! while `spec.replica.enabled` is true, and the other instances stream from it. When it turns
//! false the leader writes a fence into the source's store and promotes. The operator reports
//! ([`report`]): `status.replica` and the condition [`STANDBY`] from the leader's
//! [`Following`], and a cluster whose leader follows is Ready with the reason
//! [`STANDBY_REASON`].
//!
//! While the cluster follows, its primary is read-only (and its roles, passwords included,
//! are its source's), so nothing the operator would write there is tried: the pooler's auth
//! role ([`super::pooler`]), Databases and DatabaseRoles ([`crate::server::resolve`]) wait for
//! the promotion and say so; no base backup is scheduled and `ContinuousArchiving` says
//! why nothing is archived ([`super::backup`]).
//!
//! # Caveats
//! The position comes from the leader's own report: a leader that stopped reporting leaves
//! the last reported position in `status.replica` (the condition then says nobody follows).

use steward_core::conditions::{self, Wanted};
use steward_core::events;
use steward_database_api::contract::{FENCE_OBJECT, Following, InstanceStatus, Role};

use crate::crd::{
    ObjectStore, PostgresClusterSpec, PostgresClusterStatus, ReplicaSpec, ReplicaStatus,
};

/// The condition on a cluster with `spec.replica`: whether it is a standby of its source.
pub const STANDBY: &str = "Standby";
/// The reason of `Ready` while the cluster is a standby whose leader follows its source.
pub const STANDBY_REASON: &str = "Standby";

/// The source `spec` follows while `spec.replica.enabled` (its primary is then read-only).
pub fn follows(spec: &PostgresClusterSpec) -> Option<&ObjectStore> {
    spec.replica
        .as_ref()
        .filter(|r| r.enabled)
        .map(|r| &r.source)
}

/// The cluster's leader as it reports itself: its pod's name and its
/// [`InstanceStatus`].
#[derive(Clone, Copy, Debug)]
pub struct Leader<'a> {
    pub name: &'a str,
    pub report: &'a InstanceStatus,
}

impl Leader<'_> {
    /// What it follows, while it runs as a standby of the source.
    fn following(&self) -> Option<&Following> {
        self.report
            .following
            .as_ref()
            .filter(|_| self.report.role == Role::Replica)
    }
}

/// What [`report`] decided.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// `status.replica` (`None` without `spec.replica`).
    pub status: Option<ReplicaStatus>,
    /// [`STANDBY`] (`None` removes it).
    pub condition: Option<Wanted>,
    /// The leader follows the source as `spec.replica.enabled` asks: the cluster is a
    /// serving standby (Ready, if its instances are, with [`STANDBY_REASON`]).
    pub following: bool,
}

/// `status.replica` and the [`STANDBY`] condition of a cluster with `spec` as its
/// `spec.replica`, whose leader reports `leader` (`None`: no leader, or it reported nothing
/// readable), the last status written being `previous`.
pub fn report(
    spec: Option<&ReplicaSpec>,
    leader: Option<Leader<'_>>,
    previous: Option<&ReplicaStatus>,
) -> Report {
    let Some(spec) = spec else {
        return Report::default();
    };
    let source = spec.source.url();
    // The last known position, unless it was of another source.
    let mut status = previous
        .filter(|p| p.source == source)
        .cloned()
        .unwrap_or_default();
    status.source.clone_from(&source);
    status.enabled = spec.enabled;
    let following = leader.as_ref().and_then(Leader::following);
    if let Some(f) = following {
        status.replayed_lsn = Some(f.replayed.to_string());
        if f.replayed_at.is_some() {
            status.last_replayed_at.clone_from(&f.replayed_at);
        }
        if f.source_wal.is_some() {
            status.source_wal.clone_from(&f.source_wal);
        }
        status.lag_bytes = Some(f.lag_bytes);
        status.source_reachable = Some(f.source_error.is_none());
        status.source_error.clone_from(&f.source_error);
        status.demotion_token.clone_from(&f.demotion_token);
    }
    let position = position(&status);
    let replayed = position.as_ref().map_or_else(
        || "nothing replayed yet".to_string(),
        |p| format!("replayed up to {p}"),
    );
    let problem = leader
        .and_then(|l| Some(format!("; {}: {}", l.name, l.report.problem.as_deref()?)))
        .unwrap_or_default();
    let demoted = status
        .demotion_token
        .as_ref()
        .map(|t| format!("; demoted, its WAL ended at {t} (the spec.replica.promotionToken of the cluster that takes over)"))
        .unwrap_or_default();
    let condition = match (spec.enabled, following, leader) {
        (true, Some(f), _) => match &f.source_error {
            None => Wanted::holds(
                "Following",
                format!(
                    "following {source}: {replayed}, {} bytes behind its archive{demoted}",
                    f.lag_bytes
                ),
            ),
            Some(why) => Wanted::holds(
                "SourceUnreachable",
                format!(
                    "following {source}, whose object store could not be listed: {why}; {replayed}, {} bytes behind when last listed{demoted}",
                    f.lag_bytes
                ),
            ),
        },
        (true, None, Some(l)) if l.report.role == Role::Primary => Wanted::fails(
            "Demoting",
            format!(
                "spec.replica.enabled: the leader {} still runs read-write; it stops as the primary, then follows {source}{problem}",
                l.name
            ),
        ),
        (true, None, _) => Wanted::fails(
            "NotFollowingYet",
            format!(
                "no instance follows {source} yet: the leader restores the source's newest base backup, then replays its archived WAL{problem}"
            ),
        ),
        (false, None, Some(l)) if l.report.role == Role::Primary => Wanted::fails(
            "Promoted",
            format!(
                "promoted: it no longer follows {source}, whose object store its leader fenced ({FENCE_OBJECT}) before it accepted writes{}",
                position
                    .as_ref()
                    .map(|p| format!("; the replay of the source ended at {p}"))
                    .unwrap_or_default()
            ),
        ),
        (false, _, _) => Wanted::holds(
            "Promoting",
            format!(
                "promotion asked (spec.replica.enabled: false): the leader {}fences {source}'s object store ({FENCE_OBJECT}), then promotes; {replayed}{problem}",
                spec.promotion_token
                    .as_ref()
                    .map(|t| format!("replays up to the promotion token {t}, "))
                    .unwrap_or_default()
            ),
        ),
    };
    Report {
        status: Some(status),
        condition: Some(condition),
        following: spec.enabled && following.is_some(),
    }
}

/// Where `status` says the replay is: `<lsn> (last transaction committed at <t>)`.
fn position(status: &ReplicaStatus) -> Option<String> {
    let lsn = status.replayed_lsn.as_ref()?;
    Some(match &status.last_replayed_at {
        Some(at) => format!("{lsn} (last transaction committed at {at})"),
        None => lsn.clone(),
    })
}

/// What `Ready` adds while the cluster is a serving standby of `source` (no figures, so a
/// standby that keeps replaying keeps its message).
pub fn ready_note(source: &ObjectStore) -> String {
    format!(
        "a read-only standby of {}: see the Standby condition and status.replica",
        source.url()
    )
}

/// The Event of a promotion, once [`STANDBY`] says `Promoted` in `now` where the status
/// written before (`previous`) did not. Publish it only once `now` was written (as
/// `status::transition`): a reconcile of a stale copy would report it again.
pub fn promoted_event(
    previous: Option<&PostgresClusterStatus>,
    now: &PostgresClusterStatus,
) -> Option<events::Wanted> {
    let reason = |s: &PostgresClusterStatus| {
        conditions::get(&s.conditions, STANDBY).map(|c| c.reason.clone())
    };
    let promoted = conditions::get(&now.conditions, STANDBY).filter(|c| c.reason == "Promoted")?;
    (previous.and_then(reason).as_deref() != Some("Promoted"))
        .then(|| events::Wanted::normal("Promoted", "Promote", promoted.message.clone()))
}

#[cfg(test)]
pub(crate) mod tests {
    use steward_database_api::contract::Lsn;

    use super::*;

    /// The store a standby of the cluster tests follows: `s3://dr/prod/orders`.
    pub(crate) fn source_store() -> ObjectStore {
        ObjectStore {
            endpoint: "https://s3.example".into(),
            bucket: "dr".into(),
            path: "prod/orders".into(),
            region: None,
            credentials_secret: "s3".into(),
        }
    }

    fn spec(enabled: bool) -> ReplicaSpec {
        ReplicaSpec {
            enabled,
            source: ObjectStore {
                endpoint: "https://s3.example".into(),
                bucket: "dr".into(),
                path: "prod/orders/".into(),
                region: None,
                credentials_secret: "dr-s3".into(),
            },
            promotion_token: None,
        }
    }

    fn instance(role: Role, following: Option<Following>) -> InstanceStatus {
        InstanceStatus {
            role,
            timeline: 1,
            lsn: Lsn(0x300_0060),
            replay_lag: 0,
            archiver: None,
            commits_waiting: 0,
            problem: None,
            following,
        }
    }

    fn follows_at(lsn: u64, lag: u64, error: Option<&str>) -> Following {
        Following {
            source: "s3://dr/prod/orders".into(),
            replayed: Lsn(lsn),
            replayed_at: Some("2026-12-02T03:04:05Z".into()),
            source_wal: Some("000000010000000000000004".into()),
            lag_bytes: lag,
            source_error: error.map(Into::into),
            demotion_token: None,
        }
    }

    fn leader(report: &InstanceStatus) -> Option<Leader<'_>> {
        Some(Leader {
            name: "pg-0",
            report,
        })
    }

    #[test]
    fn a_cluster_without_spec_replica_reports_nothing() {
        let report = report(None, None, Some(&ReplicaStatus::default()));
        assert_eq!(report, Report::default());
    }

    #[test]
    fn a_following_leader_makes_a_serving_standby_and_its_position_is_the_status() {
        let following = instance(Role::Replica, Some(follows_at(0x300_0060, 4096, None)));
        let r = report(Some(&spec(true)), leader(&following), None);
        assert!(r.following);
        let status = r.status.unwrap();
        assert_eq!(
            status,
            ReplicaStatus {
                source: "s3://dr/prod/orders".into(),
                enabled: true,
                replayed_lsn: Some("0/3000060".into()),
                last_replayed_at: Some("2026-12-02T03:04:05Z".into()),
                lag_bytes: Some(4096),
                source_wal: Some("000000010000000000000004".into()),
                source_reachable: Some(true),
                source_error: None,
                demotion_token: None,
            }
        );
        let condition = r.condition.unwrap();
        assert!(condition.status);
        assert_eq!(condition.reason, "Following");
        assert!(
            condition.message.starts_with("following s3://dr/prod/orders: replayed up to 0/3000060 (last transaction committed at 2026-12-02T03:04:05Z), 4096 bytes behind"),
            "{}",
            condition.message
        );
    }

    /// The source's store gone (the disaster): the standby still serves what it replayed, and
    /// says the source cannot be reached, with the last figures it had.
    #[test]
    fn an_unreachable_source_is_said_and_the_standby_still_serves() {
        let previous = report(
            Some(&spec(true)),
            leader(&instance(
                Role::Replica,
                Some(follows_at(0x300_0060, 0, None)),
            )),
            None,
        )
        .status;
        let mut lost = follows_at(0x300_0060, 0, Some("connection refused"));
        lost.replayed_at = None;
        lost.source_wal = None;
        let unreachable = instance(Role::Replica, Some(lost));
        let r = report(Some(&spec(true)), leader(&unreachable), previous.as_ref());
        assert!(r.following);
        let status = r.status.unwrap();
        assert_eq!(status.source_reachable, Some(false));
        assert_eq!(status.source_error.as_deref(), Some("connection refused"));
        assert_eq!(
            (
                status.last_replayed_at.as_deref(),
                status.source_wal.as_deref()
            ),
            (
                Some("2026-12-02T03:04:05Z"),
                Some("000000010000000000000004")
            ),
            "what was last known is kept"
        );
        let condition = r.condition.unwrap();
        assert!(condition.status);
        assert_eq!(condition.reason, "SourceUnreachable");
        assert!(
            condition.message.contains("connection refused"),
            "{}",
            condition.message
        );
    }

    #[test]
    fn nobody_following_yet_is_no_serving_standby_and_says_what_keeps_it() {
        let mut restoring = instance(Role::Down, None);
        restoring.problem = Some("no base backup in s3://dr/prod/orders".into());
        let r = report(Some(&spec(true)), leader(&restoring), None);
        assert!(!r.following);
        let condition = r.condition.unwrap();
        assert!(!condition.status);
        assert_eq!(condition.reason, "NotFollowingYet");
        assert!(
            condition
                .message
                .ends_with("; pg-0: no base backup in s3://dr/prod/orders"),
            "{}",
            condition.message
        );
        let status = r.status.unwrap();
        assert_eq!(
            (status.replayed_lsn, status.source_reachable),
            (None, None),
            "nothing known yet"
        );
        let r = report(Some(&spec(true)), None, None);
        assert_eq!(r.condition.unwrap().reason, "NotFollowingYet");
        // A primary asked to follow (a demotion) is no standby until it does.
        let primary = instance(Role::Primary, None);
        let r = report(Some(&spec(true)), leader(&primary), None);
        assert!(!r.following);
        assert_eq!(r.condition.unwrap().reason, "Demoting");
    }

    /// A demoted cluster publishes where its WAL ended, for the promotion token of the
    /// cluster that takes over; that one says it waits for it.
    #[test]
    fn a_demotion_token_is_published_and_a_promotion_token_awaited() {
        let mut f = follows_at(0x300_0060, 0, None);
        f.demotion_token = Some("1:0/3000060".into());
        let demoted = instance(Role::Replica, Some(f));
        let r = report(Some(&spec(true)), leader(&demoted), None);
        assert_eq!(
            r.status.unwrap().demotion_token.as_deref(),
            Some("1:0/3000060")
        );
        let condition = r.condition.unwrap();
        assert!(
            condition
                .message
                .contains("demoted, its WAL ended at 1:0/3000060"),
            "{}",
            condition.message
        );
        let mut planned = spec(false);
        planned.promotion_token = Some("1:0/3000060".into());
        let following = instance(Role::Replica, Some(follows_at(0x300_0000, 0, None)));
        let condition = report(Some(&planned), leader(&following), None)
            .condition
            .unwrap();
        assert_eq!(condition.reason, "Promoting");
        assert!(
            condition
                .message
                .contains("replays up to the promotion token 1:0/3000060, fences"),
            "{}",
            condition.message
        );
    }

    /// `enabled: false`: promoting until the leader runs read-write, then promoted, with
    /// where the replay ended (the data-loss bound) kept in the status.
    #[test]
    fn a_promotion_is_promoting_until_the_leader_is_primary_and_keeps_where_the_replay_ended() {
        let following = instance(Role::Replica, Some(follows_at(0x500_0000, 8192, None)));
        let before = report(Some(&spec(true)), leader(&following), None);
        let promoting = report(
            Some(&spec(false)),
            leader(&following),
            before.status.as_ref(),
        );
        assert!(!promoting.following, "asked to stop following");
        let condition = promoting.condition.clone().unwrap();
        assert_eq!((condition.status, condition.reason), (true, "Promoting"));
        assert!(!promoting.status.as_ref().unwrap().enabled);

        let primary = instance(Role::Primary, None);
        let promoted = report(
            Some(&spec(false)),
            leader(&primary),
            promoting.status.as_ref(),
        );
        let condition = promoted.condition.clone().unwrap();
        assert_eq!((condition.status, condition.reason), (false, "Promoted"));
        assert!(
            condition.message.contains("fence.json")
                && condition.message.contains("ended at 0/5000000"),
            "{}",
            condition.message
        );
        let status = promoted.status.clone().unwrap();
        assert_eq!(status.replayed_lsn.as_deref(), Some("0/5000000"));
        assert_eq!(status.lag_bytes, Some(8192), "the lag when it stopped");

        // The Event once, when Promoted first shows.
        let with = |r: &Report| {
            let mut s = PostgresClusterStatus::default();
            conditions::set_wanted(&mut s.conditions, STANDBY, r.condition.as_ref(), Some(1));
            s
        };
        let event = promoted_event(Some(&with(&promoting)), &with(&promoted)).unwrap();
        assert_eq!(event.reason, "Promoted");
        assert!(event.note.contains("fence.json"), "{}", event.note);
        assert_eq!(
            promoted_event(None, &with(&promoted)).unwrap().reason,
            "Promoted"
        );
        assert_eq!(
            promoted_event(Some(&with(&promoted)), &with(&promoted)),
            None
        );
        assert_eq!(
            promoted_event(Some(&with(&before)), &with(&promoting)),
            None
        );
    }

    #[test]
    fn only_an_enabled_replica_spec_follows() {
        let mut c = crate::cluster::tests::cluster("pg").spec;
        assert!(follows(&c).is_none());
        c.replica = Some(spec(false));
        assert!(follows(&c).is_none());
        c.replica = Some(spec(true));
        assert_eq!(
            follows(&c).map(ObjectStore::url).as_deref(),
            Some("s3://dr/prod/orders")
        );
    }
}
