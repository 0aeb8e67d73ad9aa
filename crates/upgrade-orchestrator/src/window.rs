//! Maintenance windows: when a plan may start components (pure).
//!
//! A window opens at each time its cron `schedule` matches, in its `timeZone` (IANA name,
//! default UTC; daylight saving is the time zone's), and stays open for `duration`. A plan
//! with windows starts a component only while at least one is open. Outside, nothing new
//! starts; components already upgrading are followed to the end, and rollbacks (after a
//! failure, or of a deleted plan) are never held back: a window gates risk, not its repair.

use std::time::Duration;

use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use jiff::tz::TimeZone;
use jiff::{SignedDuration, Timestamp, Zoned};

use crate::crd::MaintenanceWindow;

/// Where `now` falls with respect to a plan's windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Window {
    /// The plan has no windows: components start at any time.
    Always,
    /// Inside a window, which closes at `closes` (the latest close among open windows).
    Open { closes: Timestamp },
    /// Outside every window; the next opens at `opens`, described by `window`.
    Closed { opens: Zoned, window: String },
}

pub use steward_upgrade_api::NEXT_OPENING;

/// The longest window: longer ones are almost certainly a typo (`duration: 2000h`).
const MAX_DURATION: Duration = Duration::from_secs(31 * 24 * 3600);

/// A window, parsed.
struct Parsed {
    cron: Cron,
    tz: TimeZone,
    length: SignedDuration,
    describe: String,
}

fn parse(index: usize, w: &MaintenanceWindow) -> Result<Parsed, String> {
    let at = |why: String| format!("spec.strategy.maintenanceWindows[{index}]: {why}");
    let fields = w.schedule.split_whitespace().count();
    if fields != 5 && !w.schedule.trim_start().starts_with('@') {
        return Err(at(format!(
            "schedule {:?} has {fields} fields; expected 5 (minute hour day-of-month month day-of-week) or a nickname such as @daily",
            w.schedule
        )));
    }
    let cron = CronParser::builder()
        .seconds(Seconds::Disallowed)
        .year(Year::Disallowed)
        .build()
        .parse(&w.schedule)
        .map_err(|e| at(format!("schedule {:?}: {e}", w.schedule)))?;
    let zone = w.time_zone.as_deref().unwrap_or("UTC");
    let tz = TimeZone::get(zone)
        .map_err(|e| at(format!("timeZone {zone:?} is not an IANA time zone: {e}")))?;
    let length = steward_core::cli::parse_duration(&w.duration)
        .map_err(|e| at(format!("duration {:?}: {e}", w.duration)))?;
    if length.is_zero() || length > MAX_DURATION {
        return Err(at(format!(
            "duration {:?} must be more than 0 and at most 31 days",
            w.duration
        )));
    }
    let length = SignedDuration::try_from(length).map_err(|e| at(e.to_string()))?;
    Ok(Parsed {
        cron,
        tz,
        length,
        describe: format!("{} {zone} for {}", w.schedule, w.duration),
    })
}

/// Checks every window (so an invalid one is reported even while another is open) and says
/// where `now` falls.
///
/// # Errors
/// A message naming the first invalid window and what is wrong with it.
pub fn check(windows: &[MaintenanceWindow], now: Timestamp) -> Result<Window, String> {
    let parsed = windows
        .iter()
        .enumerate()
        .map(|(i, w)| parse(i, w))
        .collect::<Result<Vec<_>, _>>()?;
    if parsed.is_empty() {
        return Ok(Window::Always);
    }
    let mut closes: Option<Timestamp> = None;
    let mut next: Option<(Zoned, String)> = None;
    for w in &parsed {
        let local = now.to_zoned(w.tz.clone());
        // The latest opening at or before now is the one that closes last.
        if let Ok(opened) = w.cron.find_previous_occurrence(&local, true) {
            let close = opened.timestamp() + w.length;
            if close > now {
                closes = Some(closes.map_or(close, |c| c.max(close)));
            }
        }
        if let Ok(opens) = w.cron.find_next_occurrence(&local, false)
            && next
                .as_ref()
                .is_none_or(|(n, _)| opens.timestamp() < n.timestamp())
        {
            next = Some((opens, w.describe.clone()));
        }
    }
    match (closes, next) {
        (Some(closes), _) => Ok(Window::Open { closes }),
        (None, Some((opens, window))) => Ok(Window::Closed { opens, window }),
        (None, None) => Err(format!(
            "spec.strategy.maintenanceWindows: no window ever opens ({})",
            parsed
                .iter()
                .map(|p| p.describe.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        )),
    }
}

/// How long from `now` until `at` (zero when past), for a recheck timer.
pub fn until(now: Timestamp, at: Timestamp) -> Duration {
    Duration::try_from(at.duration_since(now)).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    /// `"<schedule>|<duration>[|<time zone>]"`.
    fn windows(list: &[&str]) -> Vec<MaintenanceWindow> {
        list.iter()
            .map(|w| {
                let mut parts = w.split('|');
                MaintenanceWindow {
                    schedule: parts.next().unwrap().to_string(),
                    duration: parts.next().unwrap().to_string(),
                    time_zone: parts.next().map(str::to_string),
                }
            })
            .collect()
    }

    #[test]
    fn no_windows_means_any_time() {
        assert_eq!(check(&[], at("2026-12-01T12:00:00Z")), Ok(Window::Always));
    }

    #[test]
    fn a_window_is_open_from_its_schedule_for_its_duration() {
        let w = windows(&["0 2 * * *|4h"]);
        let open = check(&w, at("2026-12-01T03:59:59Z")).unwrap();
        assert_eq!(
            open,
            Window::Open {
                closes: at("2026-12-01T06:00:00Z")
            }
        );
        assert_eq!(
            check(&w, at("2026-12-01T02:00:00Z")).unwrap(),
            open,
            "open at its first second"
        );
        let Window::Closed { opens, window } = check(&w, at("2026-12-01T06:00:00Z")).unwrap()
        else {
            panic!("closed at its end")
        };
        assert_eq!(opens.timestamp(), at("2026-12-02T02:00:00Z"));
        assert_eq!(window, "0 2 * * * UTC for 4h");
    }

    #[test]
    fn a_window_follows_its_time_zone_and_daylight_saving() {
        // 02:00 in Berlin is 01:00 UTC in winter, 00:00 UTC in summer.
        let w = windows(&["0 2 * * *|1h|Europe/Berlin"]);
        assert!(matches!(
            check(&w, at("2026-12-01T01:30:00Z")),
            Ok(Window::Open { .. })
        ));
        assert!(matches!(
            check(&w, at("2026-07-01T00:30:00Z")),
            Ok(Window::Open { .. })
        ));
        assert!(matches!(
            check(&w, at("2026-07-01T01:30:00Z")),
            Ok(Window::Closed { .. })
        ));
    }

    #[test]
    fn the_earliest_next_opening_and_the_latest_close_win() {
        let w = windows(&["0 22 * * *|1h", "0 20 * * *|3h"]);
        let Window::Closed { opens, window } = check(&w, at("2026-12-01T12:00:00Z")).unwrap()
        else {
            panic!("closed")
        };
        assert_eq!(opens.timestamp(), at("2026-12-01T20:00:00Z"));
        assert!(window.starts_with("0 20"), "{window}");
        assert_eq!(
            check(&w, at("2026-12-01T22:30:00Z")).unwrap(),
            Window::Open {
                closes: at("2026-12-01T23:00:00Z")
            }
        );
    }

    #[test]
    fn a_weekend_window_skips_the_week() {
        // Saturdays 01:00–05:00 UTC; 2026-12-01 is a Tuesday.
        let w = windows(&["0 1 * * SAT|4h"]);
        let Window::Closed { opens, .. } = check(&w, at("2026-12-01T02:00:00Z")).unwrap() else {
            panic!("closed on a Tuesday")
        };
        assert_eq!(opens.timestamp(), at("2026-12-05T01:00:00Z"));
    }

    #[test]
    fn invalid_windows_are_refused_naming_the_window_and_the_rule() {
        for (bad, words) in [
            ("0 2 * *|4h", "4 fields"),
            ("0 2 * * * *|4h", "6 fields"),
            ("61 2 * * *|4h", "schedule"),
            ("0 2 * * *|soon", "duration"),
            ("0 2 * * *|0s", "more than 0"),
            ("0 2 * * *|800h", "31 days"),
            ("0 2 * * *|4h|Mars/Olympus", "IANA"),
        ] {
            let w = windows(&["* * * * *|1h", bad]);
            let err = check(&w, at("2026-12-01T12:00:00Z")).unwrap_err();
            assert!(
                err.contains("maintenanceWindows[1]") && err.contains(words),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn until_is_zero_for_the_past() {
        let now = at("2026-12-01T12:00:00Z");
        assert_eq!(
            until(now, at("2026-12-01T12:00:30Z")),
            Duration::from_secs(30)
        );
        assert_eq!(until(now, at("2026-12-01T11:00:00Z")), Duration::ZERO);
    }
}
