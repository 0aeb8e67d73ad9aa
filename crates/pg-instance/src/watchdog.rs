//! The fence that holds even when the instance manager cannot act: a second process that
//! stops PostgreSQL when the primary's right to write runs out.
//!
//! The manager sends the watchdog (its child, over a pipe) `P <ms> <pid>` while it is the
//! primary — "the postmaster `pid` may accept writes for `ms` more" (its Lease renewal plus
//! the renew deadline, measured before sending) — and `S` when it is not. If no newer
//! message arrives in time (the manager is paused with SIGSTOP, starved or hung, or the
//! Lease could not be renewed), the watchdog sends the postmaster SIGQUIT (immediate
//! shutdown; SIGKILL a second later if it is still there). It does the same when the pipe
//! closes while a deadline is set. Since the renew deadline is shorter than the Lease
//! duration, PostgreSQL stops accepting writes before another instance can be promoted.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

/// What the watchdog knows: until when which postmaster may run as primary.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fence {
    pub deadline: Option<(Instant, i32)>,
}

/// A message from the manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// The postmaster `pid` may accept writes for `valid_for` more.
    Primary { valid_for: Duration, pid: i32 },
    /// Not the primary: nothing to fence.
    Standby,
}

impl Message {
    pub fn encode(&self) -> String {
        match self {
            Message::Primary { valid_for, pid } => format!("P {} {pid}\n", valid_for.as_millis()),
            Message::Standby => "S\n".into(),
        }
    }

    pub fn decode(line: &str) -> Option<Message> {
        let mut words = line.split_whitespace();
        match words.next()? {
            "P" => {
                let ms: u64 = words.next()?.parse().ok()?;
                let pid: i32 = words.next()?.parse().ok()?;
                Some(Message::Primary {
                    valid_for: Duration::from_millis(ms),
                    pid,
                })
            }
            "S" => Some(Message::Standby),
            _ => None,
        }
    }
}

impl Fence {
    /// Applies a message received at `now` (the validity counts from receipt, which is
    /// after the manager measured it: conservative).
    pub fn receive(&mut self, message: &Message, now: Instant) {
        self.deadline = match message {
            Message::Primary { valid_for, pid } => Some((now + *valid_for, *pid)),
            Message::Standby => None,
        };
    }

    /// The postmaster to stop, if its deadline passed at `now`.
    pub fn expired(&self, now: Instant) -> Option<i32> {
        self.deadline
            .and_then(|(deadline, pid)| (now >= deadline).then_some(pid))
    }
}

/// Runs the watchdog on standard input until it closes.
pub async fn run() {
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut fence = Fence::default();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            line = lines.next_line() => match line {
                Ok(Some(line)) => {
                    if let Some(message) = Message::decode(&line) {
                        fence.receive(&message, Instant::now());
                    }
                }
                _ => {
                    if let Some((_, pid)) = fence.deadline {
                        tracing::error!(pid, "instance manager gone while primary: stopping PostgreSQL");
                        stop(pid).await;
                    }
                    return;
                }
            },
            _ = tick.tick() => {
                if let Some(pid) = fence.expired(Instant::now()) {
                    tracing::error!(pid, "the primary's right to write ran out without a renewal: stopping PostgreSQL (immediate)");
                    stop(pid).await;
                    fence.deadline = None;
                }
            }
        }
    }
}

/// SIGQUIT (immediate shutdown), then SIGKILL if the postmaster is still there after 1 s.
async fn stop(pid: i32) {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let pid = Pid::from_raw(pid);
    if kill(pid, Signal::SIGQUIT).is_err() {
        return;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let _ = kill(pid, Signal::SIGKILL);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        for m in [
            Message::Primary {
                valid_for: Duration::from_millis(5900),
                pid: 42,
            },
            Message::Standby,
        ] {
            assert_eq!(Message::decode(&m.encode()), Some(m));
        }
        assert_eq!(Message::decode("P x 1"), None);
        assert_eq!(Message::decode(""), None);
    }

    #[test]
    fn the_postmaster_is_fenced_only_after_its_validity_runs_out() {
        let t0 = Instant::now();
        let mut fence = Fence::default();
        assert_eq!(fence.expired(t0 + Duration::from_secs(100)), None);
        fence.receive(
            &Message::Primary {
                valid_for: Duration::from_secs(6),
                pid: 7,
            },
            t0,
        );
        assert_eq!(fence.expired(t0 + Duration::from_millis(5999)), None);
        assert_eq!(fence.expired(t0 + Duration::from_secs(6)), Some(7));
        fence.receive(
            &Message::Primary {
                valid_for: Duration::from_secs(6),
                pid: 7,
            },
            t0 + Duration::from_secs(5),
        );
        assert_eq!(fence.expired(t0 + Duration::from_secs(10)), None, "renewed");
        fence.receive(&Message::Standby, t0 + Duration::from_secs(10));
        assert_eq!(
            fence.expired(t0 + Duration::from_secs(100)),
            None,
            "stood down"
        );
    }
}
