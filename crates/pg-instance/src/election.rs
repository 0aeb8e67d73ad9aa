//! Which instance may become primary when the Lease is free: a pure function of what the
//! instances published on their pods.
//!
//! The Lease decides *that* there is exactly one primary (steward-core's elector: one
//! resourceVersion-guarded write wins); this decides *who should try*: the most advanced
//! running replica, so the promotion loses as little acknowledged WAL as possible.

use k8s_openapi::api::coordination::v1::Lease;

use crate::contract::{self, InstanceStatus, Role, WalEnd, ordinal};

/// Another instance of the cluster, as listed.
#[derive(Clone, Debug)]
pub struct Peer {
    pub name: String,
    /// The pod's `Ready` condition: its instance manager answers and PostgreSQL runs in
    /// its role. A peer that is not ready is not waited for.
    pub ready: bool,
    pub status: Option<InstanceStatus>,
}

/// Whether this instance should try to take the free Lease, and why (for the log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Candidacy {
    /// No Lease yet: the first instance (ordinal 0) bootstraps the cluster.
    Bootstrap,
    /// A running replica at least as advanced as every other ready replica.
    MostAdvanced,
    /// Not a running replica (no data yet, or PostgreSQL is down).
    NotRunning,
    /// No Lease yet and this is not ordinal 0.
    NotFirst,
    /// `peer` has received more WAL, or as much and it is the switchover target, or as much
    /// and neither is the target and it has a lower ordinal.
    Behind { peer: String },
    /// The primary that released the Lease on a clean stop, back: it has every write.
    LastPrimary,
    /// The Lease was released on a clean stop by `peer`, whose pod exists or which the
    /// StatefulSet still counts: it comes back as the primary (a replica stopped before it
    /// may lack its last writes).
    WaitingForLastPrimary { peer: String },
}

impl Candidacy {
    pub fn eligible(&self) -> bool {
        matches!(
            self,
            Candidacy::Bootstrap | Candidacy::MostAdvanced | Candidacy::LastPrimary
        )
    }
}

/// The record a primary left on the Lease when it stopped cleanly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CleanStop<'a> {
    /// The instance that released the Lease.
    pub last_primary: &'a str,
    /// Where its WAL ends. `None`: not recorded (an older instance manager, or reading the
    /// stopped data directory failed).
    pub wal_end: Option<WalEnd>,
}

/// The clean-stop record on the Lease ([`contract::LAST_PRIMARY_ANNOTATION`] and
/// [`contract::LAST_PRIMARY_WAL_ANNOTATION`], empty values as none), as written: what an
/// eligibility decision was made on. The elector takes a released Lease only if the record on
/// it is the one the instance manager last decided on ([`Decided::allows`]): a primary that
/// stopped cleanly writes the record and releases the Lease in quick succession, and a replica
/// eligible a moment before (with no record) must not take the Lease before it has decided on
/// the new record (it may lack that primary's last writes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanStopRecord {
    pub last_primary: Option<String>,
    pub wal_end: Option<String>,
}

/// The value of the Lease's annotation `key`, an empty value as none (the Lease's annotations
/// name instances; an empty value names none).
pub fn named_on(lease: &Lease, key: &str) -> Option<String> {
    lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .filter(|v| !v.is_empty())
        .cloned()
}

impl CleanStopRecord {
    /// The record on `lease` (none when it has no annotations).
    pub fn of(lease: &Lease) -> Self {
        Self {
            last_primary: named_on(lease, contract::LAST_PRIMARY_ANNOTATION),
            wal_end: named_on(lease, contract::LAST_PRIMARY_WAL_ANNOTATION),
        }
    }

    /// The instance that released the Lease and where its WAL ends ([`CleanStop`]).
    pub fn clean_stop(&self) -> Option<CleanStop<'_>> {
        self.last_primary.as_deref().map(|last_primary| CleanStop {
            last_primary,
            wal_end: self.wal_end.as_deref().and_then(|w| w.parse().ok()),
        })
    }
}

/// The instance manager's last eligibility decision and what it was made on: the record, and
/// whether the Lease was released (rather than held, or expired: a holder that stopped
/// renewing is still named on it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decided {
    pub eligible: bool,
    pub record: CleanStopRecord,
    pub released: bool,
}

impl Decided {
    /// Whether the elector may take `lease` (released or expired) on this decision. A
    /// decision made while the Lease was held does not cover its release: a primary writes
    /// its record while it still holds the Lease, then releases it, and a replica that
    /// decided in between (on the ordinary election, the Lease being held) must decide again
    /// on the release ([`after_clean_stop`]) before it takes the Lease.
    pub fn allows(&self, lease: &Lease) -> bool {
        self.eligible
            && self.record == CleanStopRecord::of(lease)
            && self.released == released(lease)
    }
}

/// Whether `lease` is released: it names no holder.
pub fn released(lease: &Lease) -> bool {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .is_none_or(str::is_empty)
}

/// After a clean stop of the primary (the Lease released, no switchover under way), the
/// instance that released it (`clean_stop`, from the Lease's annotations) becomes the
/// primary again when it returns, even before any replica runs: a StatefulSet that starts
/// its pods in order would otherwise wait forever for a replica to elect. The others wait
/// for it while its pod exists or its ordinal is below `instances` (the StatefulSet's
/// replicas: a pod the StatefulSet has not created yet, because it starts them one by
/// one, is coming back; one past the count was removed), unless they have every write it
/// made: a replica (`mine`) that has received its WAL up to the recorded end, on its
/// timeline, does not wait for an instance that may never come back (a drained node, a pod
/// that stays Pending, a lost volume). `None`: the ordinary election ([`candidacy`])
/// decides.
///
/// A switchover's release (a `target` named beside the record, with the WAL's end: the
/// primary releases only once the target confirmed it flushed that end) is decided here
/// too, see [`handed_over`].
pub fn after_clean_stop(
    me: &str,
    mine: Option<&InstanceStatus>,
    holder: Option<&str>,
    target: Option<&str>,
    clean_stop: Option<CleanStop<'_>>,
    instances: Option<u32>,
    peers: &[Peer],
) -> Option<Candidacy> {
    if holder != Some("") {
        return None;
    }
    if let Some(target) = target {
        return handed_over(me, mine, target, clean_stop, peers);
    }
    let stop = clean_stop.filter(|s| !s.last_primary.is_empty())?;
    let last = stop.last_primary;
    let replica = mine.filter(|s| s.role == Role::Replica);
    if last == me {
        return replica.is_none().then_some(Candidacy::LastPrimary);
    }
    if stop
        .wal_end
        .zip(replica)
        .is_some_and(|(end, mine)| end.reached_by(mine))
    {
        return None;
    }
    let counted = ordinal(last).zip(instances).is_some_and(|(o, n)| o < n);
    (counted || peers.iter().any(|p| p.name == last)).then(|| Candidacy::WaitingForLastPrimary {
        peer: last.to_string(),
    })
}

/// A Lease released by a switchover to `target`: the target confirmed it flushed the old
/// primary's WAL to its end before the release, so it has every write, whatever its last
/// *published* position says (published at most once a second, it may lag what it
/// received). Ranking the replicas on those positions could elect another replica, with an
/// older view of the target, which would then have to hand over again. So while the target
/// is a ready replica, nobody else is a candidate, and the target, once it has the recorded
/// end, is. `None` (the ordinary election decides): the release carries no WAL end (not a
/// confirmed handover), or the target is gone or not running as a replica — the most
/// advanced replica takes over, as after any failure mid-switchover.
pub fn handed_over(
    me: &str,
    mine: Option<&InstanceStatus>,
    target: &str,
    clean_stop: Option<CleanStop<'_>>,
    peers: &[Peer],
) -> Option<Candidacy> {
    let end = clean_stop.filter(|s| !s.last_primary.is_empty())?.wal_end?;
    if me == target {
        let mine = mine.filter(|s| s.role == Role::Replica)?;
        return end.reached_by(mine).then_some(Candidacy::MostAdvanced);
    }
    let running_target = peers.iter().any(|p| {
        p.name == target && p.ready && p.status.as_ref().is_some_and(|s| s.role == Role::Replica)
    });
    running_target.then(|| Candidacy::Behind {
        peer: target.to_string(),
    })
}

/// Decides for instance `me`, whose own status is `mine`.
///
/// `holder` is the Lease's last holder (`None`: no Lease exists); it is never waited for,
/// since the Lease is free only when it stopped renewing. `target` is the switchover target
/// the Lease names: while it is ready, nobody else is a candidate.
pub fn candidacy(
    me: &str,
    mine: Option<&InstanceStatus>,
    holder: Option<&str>,
    target: Option<&str>,
    peers: &[Peer],
) -> Candidacy {
    // No Lease, yet an instance runs PostgreSQL: the Lease was deleted (by hand, say), not
    // never created. Bootstrapping would hand it to `-0` whatever its WAL, while the old
    // primary may still write until it notices: the ordinary election decides, as for a
    // released Lease (issue #37, item 11).
    let running = |s: Option<&InstanceStatus>| s.is_some_and(|s| s.role != Role::Down);
    let cluster_runs = running(mine) || peers.iter().any(|p| running(p.status.as_ref()));
    let holder = match holder {
        Some(holder) => holder,
        None if cluster_runs => "",
        None if ordinal(me) == Some(0) => return Candidacy::Bootstrap,
        None => return Candidacy::NotFirst,
    };
    let Some(mine) = mine.filter(|s| s.role == Role::Replica) else {
        return Candidacy::NotRunning;
    };
    // Most WAL first (no acknowledged write is skipped), then the switchover target, then
    // the lowest ordinal.
    let rank = |name: &str, lsn| {
        (
            lsn,
            target == Some(name),
            std::cmp::Reverse(ordinal(name).unwrap_or(u32::MAX)),
        )
    };
    let my_rank = rank(me, mine.lsn);
    for peer in peers {
        if peer.name == me || peer.name == holder || !peer.ready {
            continue;
        }
        let Some(status) = peer.status.as_ref().filter(|s| s.role == Role::Replica) else {
            continue;
        };
        if rank(&peer.name, status.lsn) > my_rank {
            return Candidacy::Behind {
                peer: peer.name.clone(),
            };
        }
    }
    Candidacy::MostAdvanced
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::contract::Lsn;

    /// A replica's published status at `lsn`, timeline 1.
    pub(crate) fn replica(lsn: u64) -> InstanceStatus {
        InstanceStatus {
            role: Role::Replica,
            timeline: 1,
            lsn: Lsn(lsn),
            replay_lag: 0,
            archiver: None,
            commits_waiting: 0,
            problem: None,
            following: None,
        }
    }

    fn stop(last_primary: &str) -> CleanStop<'_> {
        CleanStop {
            last_primary,
            wal_end: None,
        }
    }

    fn peer(name: &str, ready: bool, status: Option<InstanceStatus>) -> Peer {
        Peer {
            name: name.into(),
            ready,
            status,
        }
    }

    #[test]
    fn without_a_lease_only_the_first_ordinal_bootstraps() {
        assert_eq!(
            candidacy("pg-0", None, None, None, &[]),
            Candidacy::Bootstrap
        );
        assert_eq!(
            candidacy("pg-1", None, None, None, &[]),
            Candidacy::NotFirst
        );
    }

    #[test]
    fn a_deleted_lease_is_elected_again_not_bootstrapped() {
        let peers = [
            peer("pg-0", true, Some(replica(100))),
            peer("pg-1", true, Some(replica(200))),
        ];
        assert_eq!(
            candidacy("pg-0", Some(&replica(100)), None, None, &peers),
            Candidacy::Behind {
                peer: "pg-1".into()
            }
        );
        assert_eq!(
            candidacy("pg-1", Some(&replica(200)), None, None, &peers),
            Candidacy::MostAdvanced
        );
        // A new cluster: instances that report nothing, or only that they are down.
        let down = InstanceStatus {
            role: Role::Down,
            ..replica(0)
        };
        assert_eq!(
            candidacy(
                "pg-0",
                Some(&down),
                None,
                None,
                &[peer("pg-1", false, None)]
            ),
            Candidacy::Bootstrap
        );
    }

    #[test]
    fn only_a_running_replica_is_a_candidate() {
        assert_eq!(
            candidacy("pg-1", None, Some("pg-0"), None, &[]),
            Candidacy::NotRunning
        );
        let down = InstanceStatus {
            role: Role::Down,
            ..replica(10)
        };
        assert_eq!(
            candidacy("pg-1", Some(&down), Some("pg-0"), None, &[]),
            Candidacy::NotRunning
        );
    }

    #[test]
    fn the_most_advanced_ready_replica_wins_ties_go_to_the_lower_ordinal() {
        let peers = [
            peer("pg-0", true, Some(replica(500))), // the old holder: ignored
            peer("pg-1", true, Some(replica(100))),
            peer("pg-2", true, Some(replica(200))),
        ];
        assert_eq!(
            candidacy("pg-1", Some(&replica(100)), Some("pg-0"), None, &peers),
            Candidacy::Behind {
                peer: "pg-2".into()
            }
        );
        assert_eq!(
            candidacy("pg-2", Some(&replica(200)), Some("pg-0"), None, &peers),
            Candidacy::MostAdvanced
        );
        let tied = [
            peer("pg-1", true, Some(replica(200))),
            peer("pg-2", true, Some(replica(200))),
        ];
        assert!(candidacy("pg-1", Some(&replica(200)), Some("pg-0"), None, &tied).eligible());
        assert!(!candidacy("pg-2", Some(&replica(200)), Some("pg-0"), None, &tied).eligible());
    }

    #[test]
    fn a_switchover_target_wins_ties_but_never_skips_wal() {
        let even = [
            peer("pg-1", true, Some(replica(200))),
            peer("pg-2", true, Some(replica(200))),
        ];
        assert!(
            candidacy(
                "pg-2",
                Some(&replica(200)),
                Some("pg-0"),
                Some("pg-2"),
                &even
            )
            .eligible()
        );
        assert_eq!(
            candidacy(
                "pg-1",
                Some(&replica(200)),
                Some("pg-0"),
                Some("pg-2"),
                &even
            ),
            Candidacy::Behind {
                peer: "pg-2".into()
            },
            "the lower ordinal yields to the target"
        );
        let ahead = [
            peer("pg-1", true, Some(replica(300))),
            peer("pg-2", true, Some(replica(200))),
        ];
        assert!(
            candidacy(
                "pg-1",
                Some(&replica(300)),
                Some("pg-0"),
                Some("pg-2"),
                &ahead
            )
            .eligible(),
            "a replica with more WAL than the target is promoted instead"
        );
        assert!(
            !candidacy(
                "pg-2",
                Some(&replica(200)),
                Some("pg-0"),
                Some("pg-2"),
                &ahead
            )
            .eligible()
        );
    }

    #[test]
    fn after_a_confirmed_handover_the_target_wins_whatever_it_last_published() {
        let end: WalEnd = "1:0/3000028".parse().unwrap();
        let handover = CleanStop {
            last_primary: "pg-0",
            wal_end: Some(end),
        };
        let at_end = InstanceStatus {
            lsn: end.lsn,
            ..replica(0)
        };
        // pg-2, the target, last published a position before the end; pg-1 has the end.
        let stale = [
            peer("pg-1", true, Some(at_end.clone())),
            peer("pg-2", true, Some(replica(100))),
        ];
        let decide = |me: &str, mine: &InstanceStatus, target: &str, peers: &[Peer]| {
            after_clean_stop(
                me,
                Some(mine),
                Some(""),
                Some(target),
                Some(handover),
                None,
                peers,
            )
            .unwrap_or_else(|| candidacy(me, Some(mine), Some(""), Some(target), peers))
        };
        assert_eq!(
            decide("pg-1", &at_end, "pg-2", &stale),
            Candidacy::Behind {
                peer: "pg-2".into()
            },
            "the ordinary ranking would have elected pg-1 on pg-2's stale position"
        );
        assert_eq!(
            decide("pg-2", &at_end, "pg-2", &stale),
            Candidacy::MostAdvanced
        );
        // The target not yet at the end (it confirmed it, so only its own view lags): it
        // waits for its next observation rather than running an election it may lose.
        assert!(handed_over("pg-2", Some(&replica(100)), "pg-2", Some(handover), &stale).is_none());
        // The target gone mid-switchover: the most advanced replica is elected, as ever.
        let gone = [
            peer("pg-1", true, Some(at_end.clone())),
            peer("pg-2", false, Some(replica(100))),
        ];
        assert_eq!(
            decide("pg-1", &at_end, "pg-2", &gone),
            Candidacy::MostAdvanced
        );
        // No WAL end on the record: not a confirmed handover, the ordinary election.
        let unconfirmed = CleanStop {
            wal_end: None,
            ..handover
        };
        assert!(handed_over("pg-1", Some(&at_end), "pg-2", Some(unconfirmed), &stale).is_none());
        // The Lease still held (the primary crashed mid-switchover): ordinary, too.
        assert!(
            after_clean_stop(
                "pg-1",
                Some(&at_end),
                Some("pg-0"),
                Some("pg-2"),
                Some(handover),
                None,
                &stale
            )
            .is_none()
        );
    }

    #[test]
    fn peers_not_ready_or_not_replicas_are_not_waited_for() {
        let peers = [
            peer("pg-2", false, Some(replica(900))),
            peer("pg-3", true, None),
            peer(
                "pg-4",
                true,
                Some(InstanceStatus {
                    role: Role::Down,
                    ..replica(900)
                }),
            ),
        ];
        assert_eq!(
            candidacy("pg-1", Some(&replica(1)), Some("pg-0"), None, &peers),
            Candidacy::MostAdvanced
        );
    }

    #[test]
    fn a_released_lease_is_taken_only_on_a_decision_made_on_its_clean_stop_record() {
        use std::collections::BTreeMap;
        let lease = |annotations: &[(&str, &str)]| {
            let mut l = Lease::default();
            l.metadata.annotations = Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            );
            l
        };
        let none = lease(&[]);
        let stopped = lease(&[
            (contract::LAST_PRIMARY_ANNOTATION, "pg-0"),
            (contract::LAST_PRIMARY_WAL_ANNOTATION, "1:0/3000028"),
        ]);
        // Eligible on a Lease without a record (pg-0 held it): pg-0 then stopped cleanly,
        // wrote its record and released it. Not taken until decided on that record.
        let before = Decided {
            eligible: true,
            record: CleanStopRecord::of(&none),
            released: true,
        };
        assert!(before.allows(&none));
        assert!(!before.allows(&stopped));
        let on_it = Decided {
            eligible: true,
            record: CleanStopRecord::of(&stopped),
            released: true,
        };
        assert!(on_it.allows(&stopped));
        // Decided on the record while pg-0 still held the Lease (it writes the record, then
        // releases): that decision was the ordinary election's, not one on the release.
        let mut held = stopped.clone();
        held.spec = Some(k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some("pg-0".into()),
            ..Default::default()
        });
        let while_held = Decided {
            eligible: true,
            record: CleanStopRecord::of(&held),
            released: false,
        };
        assert!(!while_held.allows(&stopped));
        // The same decision covers that Lease expiring (pg-0 named on it, not renewing).
        assert!(while_held.allows(&held));
        assert!(
            !Decided {
                eligible: false,
                ..on_it.clone()
            }
            .allows(&stopped)
        );
        // Empty values are no record, as when the next primary clears it.
        let cleared = lease(&[
            (contract::LAST_PRIMARY_ANNOTATION, ""),
            (contract::LAST_PRIMARY_WAL_ANNOTATION, ""),
        ]);
        assert!(before.allows(&cleared));
        assert_eq!(
            on_it.record.clean_stop(),
            Some(CleanStop {
                last_primary: "pg-0",
                wal_end: "1:0/3000028".parse().ok(),
            })
        );
    }

    #[test]
    fn after_a_clean_stop_the_last_primary_comes_back_first() {
        let peers = [peer("pg-1", true, Some(replica(100)))];
        // The primary released the Lease naming itself: back, and not a replica, it leads.
        assert_eq!(
            after_clean_stop("pg-0", None, Some(""), None, Some(stop("pg-0")), None, &[]),
            Some(Candidacy::LastPrimary)
        );
        assert!(Candidacy::LastPrimary.eligible());
        // Even with a replica running: that one waits for it while its pod exists.
        assert_eq!(
            after_clean_stop(
                "pg-0",
                None,
                Some(""),
                None,
                Some(stop("pg-0")),
                None,
                &peers
            ),
            Some(Candidacy::LastPrimary)
        );
        let with_last = [peer("pg-0", false, None)];
        let waiting = after_clean_stop(
            "pg-1",
            Some(&replica(100)),
            Some(""),
            None,
            Some(stop("pg-0")),
            None,
            &with_last,
        );
        assert_eq!(
            waiting,
            Some(Candidacy::WaitingForLastPrimary {
                peer: "pg-0".into()
            })
        );
        assert!(!waiting.unwrap().eligible());
        // Its pod gone (the instance removed): the ordinary election decides.
        assert_eq!(
            after_clean_stop(
                "pg-1",
                Some(&replica(100)),
                Some(""),
                None,
                Some(stop("pg-0")),
                None,
                &[]
            ),
            None
        );
    }

    /// Issue #37, item 7: a primary that stopped cleanly and could not come back (its pod
    /// Pending on a cordoned node, a lost volume) blocked the cluster for ever.
    #[test]
    fn a_replica_with_every_write_of_the_last_primary_does_not_wait_for_it() {
        let with_last = [peer("pg-0", false, None)];
        let recorded = |timeline, lsn| {
            Some(CleanStop {
                last_primary: "pg-0",
                wal_end: Some(WalEnd {
                    timeline,
                    lsn: Lsn(lsn),
                }),
            })
        };
        // Received up to the end (replica(100) is on timeline 1 at 100): the election decides.
        let complete = replica(100);
        for end in [recorded(1, 100), recorded(1, 99)] {
            assert_eq!(
                after_clean_stop(
                    "pg-1",
                    Some(&complete),
                    Some(""),
                    None,
                    end,
                    Some(2),
                    &with_last
                ),
                None
            );
        }
        // Short of it, or on another timeline, or no end recorded: it waits.
        for end in [recorded(1, 101), recorded(2, 50), Some(stop("pg-0"))] {
            assert_eq!(
                after_clean_stop(
                    "pg-1",
                    Some(&complete),
                    Some(""),
                    None,
                    end,
                    Some(2),
                    &with_last
                ),
                Some(Candidacy::WaitingForLastPrimary {
                    peer: "pg-0".into()
                })
            );
        }
        // Not a running replica: no proof, it waits.
        assert_eq!(
            after_clean_stop(
                "pg-1",
                None,
                Some(""),
                None,
                recorded(1, 1),
                Some(2),
                &with_last
            ),
            Some(Candidacy::WaitingForLastPrimary {
                peer: "pg-0".into()
            })
        );
        // The last primary itself, back with its data, still leads first.
        assert_eq!(
            after_clean_stop("pg-0", None, Some(""), None, recorded(1, 100), Some(2), &[]),
            Some(Candidacy::LastPrimary)
        );
    }

    #[test]
    fn a_last_primary_the_statefulset_has_not_created_yet_is_waited_for() {
        // Every pod deleted: the StatefulSet creates pg-0 first and pg-1 only once pg-0 is
        // ready, so pg-0 must wait for pg-1 without its pod existing.
        assert_eq!(
            after_clean_stop(
                "pg-0",
                Some(&replica(100)),
                Some(""),
                None,
                Some(stop("pg-1")),
                Some(2),
                &[]
            ),
            Some(Candidacy::WaitingForLastPrimary {
                peer: "pg-1".into()
            })
        );
        // Scaled down to one instance: pg-1 is not coming back.
        assert_eq!(
            after_clean_stop(
                "pg-0",
                Some(&replica(100)),
                Some(""),
                None,
                Some(stop("pg-1")),
                Some(1),
                &[]
            ),
            None
        );
    }

    #[test]
    fn a_held_lease_a_switchover_or_no_record_leave_it_to_the_election() {
        // Held (a crash leaves the holder's name until it expires).
        assert_eq!(
            after_clean_stop(
                "pg-0",
                None,
                Some("pg-0"),
                None,
                Some(stop("pg-0")),
                None,
                &[]
            ),
            None
        );
        // No Lease yet: bootstrap rules.
        assert_eq!(
            after_clean_stop("pg-0", None, None, None, Some(stop("pg-0")), None, &[]),
            None
        );
        // A switchover releases the Lease for its target only.
        assert_eq!(
            after_clean_stop(
                "pg-0",
                None,
                Some(""),
                Some("pg-1"),
                Some(stop("pg-0")),
                None,
                &[]
            ),
            None
        );
        // Released without a record (an older instance manager).
        assert_eq!(
            after_clean_stop("pg-0", None, Some(""), None, None, None, &[]),
            None
        );
        // The last primary running as a replica follows the ordinary rules.
        assert_eq!(
            after_clean_stop(
                "pg-0",
                Some(&replica(100)),
                Some(""),
                None,
                Some(stop("pg-0")),
                None,
                &[]
            ),
            None
        );
    }
}
