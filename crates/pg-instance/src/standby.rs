//! A standby cluster (`spec.replica`) and the fence that keeps its source from running
//! read-write once it was promoted.
//!
//! The standby's leader restores the source's newest base backup and replays the source's
//! archive as it arrives (`standby.signal`, `restore_command = wal-fetch --from-source`); its
//! other instances stream from it. When `spec.replica.enabled` turns false it promotes, but
//! first writes [`Fence`] into the source's store: the last timeline of the source it
//! replayed. A primary of the source on that timeline (or an earlier one) then never runs
//! read-write: it checks its own store's fence before it starts or promotes, and every
//! [`FENCE_CHECK`] while it runs ([`fenced`]). A second standby of the same source refuses to
//! promote over another's fence ([`may_fence`]): two promoted standbys would be two
//! primaries.

use std::time::Duration;

use crate::archive::{self, Store};
use crate::contract::{Fence, Following, Lsn, WalEnd};

/// How often a primary reads its store's fence while it runs, and a standby's leader lists
/// its source's archive for its lag.
pub const FENCE_CHECK: Duration = Duration::from_secs(10);
pub const SOURCE_LISTING: Duration = Duration::from_secs(5);

/// Why a primary on `timeline` may not run read-write: `fence` names a cluster promoted from
/// this one's archive at or after it.
pub fn fenced(fence: Option<&Fence>, timeline: u32) -> Option<String> {
    let f = fence?;
    (timeline <= f.timeline).then(|| {
        format!(
            "fenced by {}: it was promoted from this cluster's archive at {} (timeline {}, {}); this cluster runs read-write no more until it follows it (spec.replica)",
            f.promoted, f.lsn, f.timeline, f.at
        )
    })
}

/// A marker in a primary's data directory: its store was seen followed by a standby
/// ([`crate::contract::FOLLOWED_OBJECT`]), so a fence may come; while the store cannot be
/// read, it does not start read-write ([`may_start_unchecked`]).
pub const FOLLOWED_MARKER: &str = "steward-followed";

/// Whether a primary whose store cannot be read now may start (or promote) read-write
/// without checking its fence: only if no standby was ever seen following it (a fence can
/// only come from one). A cluster nobody follows keeps its failovers independent of its
/// object store's availability.
pub fn may_start_unchecked(followed: bool) -> bool {
    !followed
}

/// Whether the standby `me`, replaying the source's `timeline`, writes its fence before it
/// promotes: `Ok(true)` when the source has none or one of an earlier timeline (the source
/// moved on since: a switchback), `Ok(false)` when it already has this cluster's for this
/// timeline (a promotion that was interrupted); `Err` when another cluster was promoted from
/// the same history first.
pub fn may_fence(existing: Option<&Fence>, me: &str, timeline: u32) -> Result<bool, String> {
    match existing {
        None => Ok(true),
        Some(f) if f.timeline < timeline => Ok(true),
        Some(f) if f.promoted == me => Ok(false),
        Some(f) => Err(format!(
            "not promoting: {} was promoted from the same source first (at {}, timeline {}); a second promotion would make two primaries",
            f.promoted, f.lsn, f.timeline
        )),
    }
}

/// The newest WAL segment among archived file names (`.history`, `.backup` and `.partial`
/// files left out).
pub fn newest_segment(names: &[String]) -> Option<&str> {
    names
        .iter()
        .map(String::as_str)
        .filter(|n| archive::parse_segment(n).is_some())
        .max_by_key(|n| archive::parse_segment(n))
}

/// Bytes between `replayed` and the end of the archived `segment`: the standby is at most
/// this far behind what the source archived.
pub fn lag_bytes(segment: &str, replayed: Lsn) -> u64 {
    archive::parse_segment(segment).map_or(0, |(_, number)| {
        ((number + 1) * archive::SEGMENT_SIZE).saturating_sub(replayed.0)
    })
}

/// The source's progress as a standby's leader publishes it, from a listing of the source's
/// archive (`listed`: its WAL file names, or why it could not be listed).
pub fn following(
    source: &Store,
    replayed: Lsn,
    replayed_at: Option<String>,
    listed: &Result<Vec<String>, String>,
    demotion_token: Option<String>,
) -> Following {
    let (source_wal, source_error) = match listed {
        Ok(names) => (newest_segment(names).map(str::to_string), None),
        Err(e) => (None, Some(e.clone())),
    };
    Following {
        source: source.config().url(),
        replayed,
        replayed_at,
        lag_bytes: source_wal.as_deref().map_or(0, |s| lag_bytes(s, replayed)),
        source_wal,
        source_error,
        demotion_token,
    }
}

/// Whether a standby at `timeline`/`replayed` may promote under `token` (the source's
/// [`WalEnd`], `spec.replica.promotionToken`): it has replayed all of the source's WAL.
/// `Err` says what it waits for, or why the token is not one.
pub fn may_promote(token: Option<&str>, timeline: u32, replayed: Lsn) -> Result<(), String> {
    let Some(token) = token else {
        return Ok(()); // unplanned: at once
    };
    let end: WalEnd = token
        .parse()
        .map_err(|_| format!("spec.replica.promotionToken {token:?} is not <timeline>:<LSN>"))?;
    if timeline > end.timeline {
        return Err(format!(
            "not promoting: this cluster replays timeline {timeline}, past the promotion token's {token} (a token of an earlier switchover?)"
        ));
    }
    if timeline == end.timeline && replayed >= end.lsn {
        return Ok(());
    }
    Err(format!(
        "waiting to replay the source's WAL up to the promotion token {token} before promoting (replayed {timeline}:{replayed})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(promoted: &str, timeline: u32) -> Fence {
        Fence {
            promoted: promoted.into(),
            timeline,
            lsn: Lsn(0x3000060),
            at: "2026-12-06T05:00:00Z".into(),
        }
    }

    #[test]
    fn a_primary_at_or_before_the_fenced_timeline_is_fenced_and_a_later_one_is_not() {
        assert!(fenced(None, 1).is_none());
        let f = fence("dr/orders", 2);
        let why = fenced(Some(&f), 1).expect("fenced");
        assert!(why.contains("fenced by dr/orders"), "{why}");
        assert!(fenced(Some(&f), 2).is_some());
        // It rejoined as a standby of the promoted cluster and was promoted back later: a
        // new timeline past the fence.
        assert!(fenced(Some(&f), 3).is_none());
    }

    #[test]
    fn only_the_first_standby_promoted_fences_the_source() {
        assert_eq!(may_fence(None, "dr/a", 1), Ok(true));
        assert_eq!(may_fence(Some(&fence("dr/a", 1)), "dr/a", 1), Ok(false));
        let refused = may_fence(Some(&fence("dr/a", 1)), "dr/b", 1).unwrap_err();
        assert!(refused.contains("two primaries"), "{refused}");
        // A switchback and a later promotion: the source runs a newer timeline now.
        assert_eq!(may_fence(Some(&fence("dr/a", 1)), "dr/a", 3), Ok(true));
        assert_eq!(may_fence(Some(&fence("dr/b", 1)), "dr/a", 3), Ok(true));
    }

    #[test]
    fn only_a_followed_primary_waits_for_its_store_to_start() {
        assert!(may_start_unchecked(false));
        assert!(!may_start_unchecked(true));
    }

    #[test]
    fn a_planned_promotion_waits_for_the_whole_token() {
        assert_eq!(may_promote(None, 1, Lsn(0)), Ok(()));
        let token = "1:0/3000108";
        let waits = may_promote(Some(token), 1, Lsn(0x3000100)).unwrap_err();
        assert!(waits.contains("waiting to replay"), "{waits}");
        assert_eq!(may_promote(Some(token), 1, Lsn(0x3000108)), Ok(()));
        assert_eq!(may_promote(Some(token), 1, Lsn(0x3000200)), Ok(()));
        assert!(may_promote(Some(token), 2, Lsn(0x3000200)).is_err());
        // Still on an older timeline than the token's: the token's history is not replayed.
        assert!(may_promote(Some("2:0/3000108"), 1, Lsn(0x4000000)).is_err());
        assert!(may_promote(Some("nonsense"), 1, Lsn(0)).is_err());
    }

    #[test]
    fn the_lag_runs_to_the_end_of_the_newest_archived_segment() {
        let names: Vec<String> = [
            "000000010000000000000002",
            "000000010000000000000003.00000028.backup",
            "00000002.history",
            "000000020000000000000004",
            "000000010000000000000003",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(newest_segment(&names), Some("000000020000000000000004"));
        assert_eq!(newest_segment(&[]), None);
        let end_of_4 = 5 * archive::SEGMENT_SIZE;
        assert_eq!(
            lag_bytes("000000020000000000000004", Lsn(end_of_4 - 100)),
            100
        );
        assert_eq!(lag_bytes("000000020000000000000004", Lsn(end_of_4 + 5)), 0);
        assert_eq!(lag_bytes("not-a-segment", Lsn(0)), 0);
    }
}
