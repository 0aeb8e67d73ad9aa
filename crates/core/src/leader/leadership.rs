//! [`Leadership`]: the handle other code asks "may I write?", and [`run_while_leader`].

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::LeaseConfig;

/// Whether this process leads, shared between the elector and everyone who writes.
///
/// Cheap to clone. Obtain it from [`super::LeaderElector::leadership`] before calling
/// `run`, or use [`Leadership::always_leader`] when leader election is disabled.
///
/// # Guarantees
/// [`Leadership::is_leader`] and [`Leadership::guard`] answer from this process's monotonic
/// clock: they are true only while the last successful renewal is younger than the renew
/// deadline, even if the election loop could not run (the process was paused, the runtime
/// was starved). Since the renew deadline is shorter than the lease duration, no other
/// candidate can have taken over while they return `Ok`.
///
/// # Caveats
/// A check and the write it guards are not atomic: check right before each write, and keep
/// the write short compared with `lease_duration - renew_deadline`.
#[derive(Clone, Debug)]
pub struct Leadership {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    identity: String,
    /// `None` for [`Leadership::always_leader`].
    renew_deadline: Option<Duration>,
    /// When the last successful acquire or renewal was sent, while leading.
    renewed: Mutex<Option<Instant>>,
    leading: watch::Sender<bool>,
}

/// Why [`Leadership::guard`] refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotLeader {
    /// Another candidate leads, or none does.
    #[error("{identity} is not the leader")]
    Follower {
        /// This candidate's identity.
        identity: String,
    },
    /// This process led, but has not renewed within the renew deadline.
    #[error(
        "{identity} is no longer the leader: last renewal {since_renewal:?} ago, renew deadline {renew_deadline:?}"
    )]
    Stale {
        /// This candidate's identity.
        identity: String,
        /// How long ago the last successful renewal was sent.
        since_renewal: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
}

impl Leadership {
    pub(crate) fn new(config: &LeaseConfig) -> Self {
        Self::build(config.identity.clone(), Some(config.renew_deadline), false)
    }

    /// A handle that always leads, for `--leader-elect=false` and tests.
    pub fn always_leader() -> Self {
        Self::build(LeaseConfig::identity_from_env(), None, true)
    }

    fn build(identity: String, renew_deadline: Option<Duration>, leading: bool) -> Self {
        let (tx, _) = watch::channel(leading);
        Self {
            shared: Arc::new(Shared {
                identity,
                renew_deadline,
                renewed: Mutex::new(None),
                leading: tx,
            }),
        }
    }

    /// How long after a renewal this process still counts as leader (`None` for
    /// [`Leadership::always_leader`]). Side effects outside the API server (SQL statements)
    /// bound their run time below it.
    pub fn renew_deadline(&self) -> Option<Duration> {
        self.shared.renew_deadline
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.shared.identity
    }

    /// Whether this process leads now, including the monotonic freshness check.
    pub fn is_leader(&self) -> bool {
        self.guard().is_ok()
    }

    /// `Ok` only if this process leads and renewed within the renew deadline: call it right
    /// before every leader-only write.
    ///
    /// # Errors
    /// [`NotLeader::Follower`] when not leading, [`NotLeader::Stale`] when the last renewal
    /// is older than the renew deadline (for example after the process was stopped).
    pub fn guard(&self) -> Result<(), NotLeader> {
        self.deadline().map(|_| ())
    }

    /// Until when this process may write: its last renewal plus the renew deadline, on the
    /// monotonic clock (`None`: no deadline, for [`Leadership::always_leader`]). Each renewal
    /// moves it; a write that has not completed by then must be abandoned (the guarded
    /// client does, see [`crate::guard`]).
    ///
    /// # Errors
    /// As [`Leadership::guard`], when that instant has passed or this process does not lead.
    pub fn deadline(&self) -> Result<Option<Instant>, NotLeader> {
        let Some(renew_deadline) = self.shared.renew_deadline else {
            return Ok(None);
        };
        let follower = || NotLeader::Follower {
            identity: self.shared.identity.clone(),
        };
        let renewed = (*self.renewed()).ok_or_else(follower)?;
        let since_renewal = renewed.elapsed();
        if since_renewal < renew_deadline {
            Ok(Some(renewed + renew_deadline))
        } else {
            Err(NotLeader::Stale {
                identity: self.shared.identity.clone(),
                since_renewal,
                renew_deadline,
            })
        }
    }

    /// Leadership changes: `true` when acquired, `false` when lost or released.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.shared.leading.subscribe()
    }

    /// Resolves once this process leads (at once if it does).
    pub async fn acquired(&self) {
        let mut rx = self.subscribe();
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = rx.wait_for(|leading| *leading).await;
    }

    /// Resolves once this process no longer leads (at once if it does not). Never resolves
    /// for [`Leadership::always_leader`].
    pub async fn lost(&self) {
        let mut rx = self.subscribe();
        let _ = rx.wait_for(|leading| !*leading).await;
    }

    fn renewed(&self) -> MutexGuard<'_, Option<Instant>> {
        // The lock is never held across code that can panic; recover the value regardless.
        self.shared
            .renewed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records a successful acquire or renewal sent at `sent`. Returns true on acquisition.
    pub(crate) fn renewed_at(&self, sent: Instant) -> bool {
        *self.renewed() = Some(sent);
        self.shared
            .leading
            .send_if_modified(|leading| !std::mem::replace(leading, true))
    }

    /// Stops leading. Returns true if this process was leading.
    pub(crate) fn step_down(&self) -> bool {
        *self.renewed() = None;
        self.shared
            .leading
            .send_if_modified(|leading| std::mem::replace(leading, false))
    }

    /// The instant the last successful renewal was sent, while leading.
    pub(crate) fn last_renewal(&self) -> Option<Instant> {
        *self.renewed()
    }
}

/// Runs `f` only while this process leads: each time leadership is acquired, calls
/// `f(token)` and waits for it to finish. `token` is cancelled when leadership is lost or
/// `shutdown` is cancelled. If `f` returns while still leading, waits for the next term.
/// Returns when `shutdown` is cancelled and `f` (if running) has finished.
///
/// # Guarantees
/// `f` is never running twice at once, and after this function returns it is not running.
///
/// # Caveats
/// Cancellation is cooperative: `f` must return promptly once `token` is cancelled and
/// should still check [`Leadership::guard`] before each write. To be sure the work has
/// stopped before a graceful release, cancel this function's `shutdown` and await it before
/// cancelling the one given to [`super::LeaderElector::run`].
///
/// ```no_run
/// # async fn demo(leadership: steward_core::leader::Leadership) {
/// use tokio_util::sync::CancellationToken;
/// let shutdown = CancellationToken::new();
/// steward_core::leader::run_while_leader(leadership.clone(), shutdown, |token| {
///     let leadership = leadership.clone();
///     async move {
///         while !token.is_cancelled() {
///             if leadership.guard().is_ok() { /* leader-only write */ }
///             tokio::time::sleep(std::time::Duration::from_millis(100)).await;
///         }
///     }
/// })
/// .await;
/// # }
/// ```
pub async fn run_while_leader<F, Fut>(leadership: Leadership, shutdown: CancellationToken, mut f: F)
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            () = leadership.acquired() => {}
        }
        let token = shutdown.child_token();
        let work = f(token.clone());
        tokio::pin!(work);
        let finished = tokio::select! {
            biased;
            () = &mut work => true,
            () = leadership.lost() => false,
            () = shutdown.cancelled() => false,
        };
        if !finished {
            token.cancel();
            work.await;
        }
        // Wait for this term to end before starting `f` again.
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            () = leadership.lost() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn leadership(renew_deadline_ms: u64) -> Leadership {
        let mut config = LeaseConfig::new("lock", "ns", "me");
        config.renew_deadline = Duration::from_millis(renew_deadline_ms);
        Leadership::new(&config)
    }

    #[tokio::test(start_paused = true)]
    async fn guard_needs_a_fresh_renewal() {
        let l = leadership(2000);
        assert_eq!(
            l.guard(),
            Err(NotLeader::Follower {
                identity: "me".into()
            })
        );
        assert!(
            l.renewed_at(Instant::now()),
            "first renewal is an acquisition"
        );
        assert!(l.is_leader());
        tokio::time::advance(Duration::from_millis(1999)).await;
        assert!(l.is_leader());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(
            matches!(l.guard(), Err(NotLeader::Stale { .. })),
            "stale at the renew deadline"
        );
        assert!(
            *l.subscribe().borrow(),
            "the watch still says leading: the guard does not rely on it"
        );
        assert!(
            !l.renewed_at(Instant::now()),
            "a renewal is not a new acquisition"
        );
        assert!(l.is_leader());
        assert!(l.step_down());
        assert!(!l.is_leader());
        assert!(!l.step_down(), "stepping down twice reports once");
    }

    #[tokio::test]
    async fn always_leader_always_leads() {
        let l = Leadership::always_leader();
        assert!(l.is_leader());
        assert_eq!(l.guard(), Ok(()));
        l.acquired().await;
        assert!(!l.identity().is_empty());
    }

    #[tokio::test]
    async fn acquired_and_lost_follow_the_watch() {
        use futures::FutureExt;
        let l = leadership(10_000);
        assert!(
            l.lost().now_or_never().is_some(),
            "not leading: lost() resolves at once"
        );
        let mut acquired = std::pin::pin!(l.acquired());
        assert!(
            futures::poll!(&mut acquired).is_pending(),
            "not leading: acquired() waits"
        );
        l.renewed_at(Instant::now());
        tokio::time::timeout(Duration::from_secs(5), acquired)
            .await
            .expect("acquired() resolves once leading");
        assert!(
            l.acquired().now_or_never().is_some(),
            "leading: acquired() resolves at once"
        );
        let mut lost = std::pin::pin!(l.lost());
        assert!(
            futures::poll!(&mut lost).is_pending(),
            "leading: lost() waits"
        );
        l.step_down();
        tokio::time::timeout(Duration::from_secs(5), lost)
            .await
            .expect("lost() resolves on stepping down");
    }

    #[tokio::test(start_paused = true)]
    async fn run_while_leader_runs_once_per_term_and_stops_on_loss() {
        let l = leadership(10_000);
        let shutdown = CancellationToken::new();
        let starts = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(run_while_leader(l.clone(), shutdown.clone(), {
            let starts = starts.clone();
            let running = running.clone();
            move |token: CancellationToken| {
                let starts = starts.clone();
                let running = running.clone();
                async move {
                    starts.fetch_add(1, Ordering::SeqCst);
                    running.fetch_add(1, Ordering::SeqCst);
                    token.cancelled().await;
                    running.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            0,
            "not started before leading"
        );

        l.renewed_at(Instant::now());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            (
                starts.load(Ordering::SeqCst),
                running.load(Ordering::SeqCst)
            ),
            (1, 1)
        );

        l.step_down();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(running.load(Ordering::SeqCst), 0, "cancelled on loss");

        l.renewed_at(Instant::now());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            (
                starts.load(Ordering::SeqCst),
                running.load(Ordering::SeqCst)
            ),
            (2, 1),
            "restarted next term"
        );

        shutdown.cancel();
        task.await.expect("run_while_leader");
        assert_eq!(
            running.load(Ordering::SeqCst),
            0,
            "finished before returning"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn work_that_returns_early_is_not_restarted_in_the_same_term() {
        let l = leadership(10_000);
        let shutdown = CancellationToken::new();
        let starts = Arc::new(AtomicUsize::new(0));
        l.renewed_at(Instant::now());
        let task = tokio::spawn(run_while_leader(l.clone(), shutdown.clone(), {
            let starts = starts.clone();
            move |_token| {
                starts.fetch_add(1, Ordering::SeqCst);
                async {}
            }
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 1);
        shutdown.cancel();
        task.await.expect("run_while_leader");
    }
}
