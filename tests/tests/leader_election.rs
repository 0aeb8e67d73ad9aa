//! Leader election against a real API server, with candidate processes that are killed,
//! terminated and stopped: `steward_core::leader` candidates (`src/bin/lease-candidate.rs`)
//! and client-go `leaderelection` candidates (`crates/testenv/go/leader-candidate`).
//!
//! Every candidate appends `<identity> <unix-nanos> <term>` to its writes log while it leads,
//! after checking it still leads. Two terms of different candidates must never overlap.
//!
//! The tests run one at a time (they measure failover times) with 3 s / 2 s / 0.5 s timings.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::Api;
use steward_testenv::{ControlPlane, at_least, eventually};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

const LEASE: &str = "candidates";
const LEASE_DURATION: Duration = Duration::from_secs(3);
const RENEW_DEADLINE: Duration = Duration::from_secs(2);
const RETRY_PERIOD: Duration = Duration::from_millis(500);
/// client-go's JitterFactor: followers retry every `RETRY_PERIOD × (1 + rand × 1.2)`.
const MAX_RETRY: Duration = Duration::from_millis(1100);
/// For API round trips and process scheduling on a loaded 2-core machine.
const SLACK: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(20);

/// The tests measure failover times: run them one at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Rust,
    Go,
}

/// One candidate process, killed when dropped.
struct Candidate {
    identity: String,
    writes: PathBuf,
    stderr: PathBuf,
    child: Child,
}

impl Candidate {
    fn pid(&self) -> String {
        self.child.id().map(|p| p.to_string()).unwrap_or_default()
    }

    /// Sends `signal` (`KILL`, `TERM`, `STOP`, `CONT`) and returns the wall-clock time.
    fn signal(&self, signal: &str) -> SystemTime {
        let status = std::process::Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid())
            .status();
        assert!(
            status.is_ok_and(|s| s.success()),
            "kill -{signal} {} ({})",
            self.pid(),
            self.identity
        );
        SystemTime::now()
    }

    async fn exits_cleanly(&mut self, within: Duration) {
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} did not exit within {within:?}; see {}",
                    self.identity,
                    self.stderr.display()
                )
            })
            .expect("wait for candidate");
        assert!(
            status.success(),
            "{} exited with {status}; see {}",
            self.identity,
            self.stderr.display()
        );
    }
}

/// A Lease, its namespace, candidates, and the directory of their logs.
struct Election {
    cp: &'static ControlPlane,
    namespace: String,
    leases: Api<Lease>,
    dir: tempfile::TempDir,
    candidates: Vec<Candidate>,
}

impl Election {
    async fn new(prefix: &str) -> Self {
        let cp = steward_testenv::shared().await.expect("control plane");
        let namespace = cp.namespace(prefix).await.expect("namespace");
        let leases = Api::namespaced(cp.client().expect("client"), &namespace);
        let dir = tempfile::Builder::new()
            .prefix(&format!("steward-{prefix}-"))
            .tempdir()
            .expect("temp dir");
        Self {
            cp,
            namespace,
            leases,
            dir,
            candidates: Vec::new(),
        }
    }

    /// Starts a candidate; returns its index.
    fn start(&mut self, kind: Kind, identity: &str) -> usize {
        let writes = self.dir.path().join(format!("{identity}.writes"));
        let stderr = self.dir.path().join(format!("{identity}.log"));
        let program = match kind {
            Kind::Rust => PathBuf::from(env!("CARGO_BIN_EXE_lease-candidate")),
            Kind::Go => go_candidate(),
        };
        let ms = |d: Duration| d.as_millis().to_string();
        // `follows` reads the elector's debug line "lease held by another candidate".
        let log_filter = std::env::var("RUST_LOG").map_or_else(
            |_| "info,steward_core=debug".to_string(),
            |f| format!("{f},steward_core::leader=debug"),
        );
        let child = Command::new(program)
            .env("RUST_LOG", log_filter)
            .arg(self.cp.kubeconfig_path())
            .arg(&self.namespace)
            .arg(LEASE)
            .arg(identity)
            .arg(ms(LEASE_DURATION))
            .arg(ms(RENEW_DEADLINE))
            .arg(ms(RETRY_PERIOD))
            .arg(&writes)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stderr).expect("create candidate log"))
            .stderr(
                std::fs::File::options()
                    .append(true)
                    .open(&stderr)
                    .expect("open candidate log"),
            )
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("start {kind:?} candidate {identity}: {e}"));
        self.candidates.push(Candidate {
            identity: identity.to_string(),
            writes,
            stderr,
            child,
        });
        self.candidates.len() - 1
    }

    fn index_of(&self, identity: &str) -> usize {
        self.candidates
            .iter()
            .position(|c| c.identity == identity)
            .unwrap_or_else(|| panic!("no candidate {identity}"))
    }

    async fn lease(&self) -> Option<Lease> {
        self.leases.get_opt(LEASE).await.expect("get Lease")
    }

    /// Waits until one of `among` holds the Lease; returns it and its `acquireTime`.
    async fn leader_among(&self, among: &[&str]) -> (String, SystemTime) {
        eventually(
            &format!("one of {among:?} holds the Lease"),
            WAIT,
            || async {
                let lease = self
                    .leases
                    .get_opt(LEASE)
                    .await
                    .map_err(|e| e.to_string())?;
                let spec = lease.and_then(|l| l.spec).ok_or("no Lease yet")?;
                let holder = spec.holder_identity.clone().unwrap_or_default();
                if !among.contains(&holder.as_str()) {
                    return Err(format!("holder {holder:?}"));
                }
                let acquired = spec.acquire_time.ok_or("no acquireTime")?.0;
                let nanos = u64::try_from(acquired.as_nanosecond()).map_err(|e| e.to_string())?;
                Ok((holder, UNIX_EPOCH + Duration::from_nanos(nanos)))
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// Waits until `identity` has read the Lease and found it held by another candidate
    /// (its log says so: Steward's elector at debug level, client-go's `OnNewLeader`), so
    /// it is a running follower that could take over, or write wrongly, from now on.
    async fn follows(&self, identity: &str) {
        let candidate = &self.candidates[self.index_of(identity)];
        eventually(&format!("{identity} follows"), WAIT, || async {
            let log = std::fs::read_to_string(&candidate.stderr).unwrap_or_default();
            let observed = log.lines().any(|l| {
                l.contains("lease held by another candidate")
                    || (l.starts_with(&format!("{identity}: observed leader "))
                        && !l.ends_with(&format!(" {identity}")))
            });
            if observed {
                Ok(())
            } else {
                Err("has not read the Lease yet".to_string())
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()));
    }

    /// Waits until `identity` has logged a write after `after`; returns that write's time.
    async fn first_write_after(&self, identity: &str, after: SystemTime) -> SystemTime {
        let candidate = &self.candidates[self.index_of(identity)];
        eventually(&format!("{identity} writes"), WAIT, || async {
            read_writes(&candidate.writes)
                .into_iter()
                .map(|w| w.at)
                .find(|at| *at > after)
                .ok_or_else(|| "no write yet".to_string())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// Every write of every candidate, grouped into terms; panics if two terms overlap.
    fn assert_terms_do_not_overlap(&self) -> Vec<Term> {
        let mut terms: Vec<Term> = Vec::new();
        for candidate in &self.candidates {
            for write in read_writes(&candidate.writes) {
                match terms
                    .iter_mut()
                    .find(|t| t.identity == write.identity && t.term == write.term)
                {
                    Some(t) => {
                        t.first = t.first.min(write.at);
                        t.last = t.last.max(write.at);
                        t.writes += 1;
                    }
                    None => terms.push(Term {
                        identity: write.identity,
                        term: write.term,
                        first: write.at,
                        last: write.at,
                        writes: 1,
                    }),
                }
            }
        }
        terms.sort_by_key(|t| t.first);
        for pair in terms.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(
                a.last < b.first,
                "{} (term {}) wrote until {:?} but {} (term {}) started writing at {:?}: two leaders\n{}",
                a.identity,
                a.term,
                a.last,
                b.identity,
                b.term,
                b.first,
                self.logs()
            );
            let gap = b.first.duration_since(a.last).unwrap_or_default();
            eprintln!(
                "handover {} → {}: no writes for {gap:?}",
                a.identity, b.identity
            );
        }
        terms
    }

    /// Where to look when a test fails.
    fn logs(&self) -> String {
        let mut text = format!("candidate logs in {} (kept)", self.dir.path().display());
        for c in &self.candidates {
            let log = std::fs::read_to_string(&c.stderr).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            text.push_str(&format!("\n--- {} ---\n", c.identity));
            for line in tail.into_iter().rev() {
                text.push_str(line);
                text.push('\n');
            }
        }
        text
    }
}

impl Drop for Election {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Keep the logs of a failed test.
            let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("temp dir"));
            let _ = dir.keep();
        }
    }
}

struct Write {
    identity: String,
    at: SystemTime,
    term: String,
}

#[derive(Debug)]
struct Term {
    identity: String,
    term: String,
    first: SystemTime,
    last: SystemTime,
    writes: usize,
}

fn read_writes(path: &Path) -> Vec<Write> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let identity = words.next()?.to_string();
            let nanos: u64 = words.next()?.parse().ok()?;
            let term = words.next().unwrap_or("1").to_string();
            Some(Write {
                identity,
                at: UNIX_EPOCH + Duration::from_nanos(nanos),
                term,
            })
        })
        .collect()
}

fn since(t0: SystemTime, t: SystemTime) -> Duration {
    t.duration_since(t0).unwrap_or_default()
}

/// Builds the client-go candidate next to `lease-candidate` (once per test binary).
fn go_candidate() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let rust = PathBuf::from(env!("CARGO_BIN_EXE_lease-candidate"));
            let out = rust.with_file_name("leader-candidate-go");
            let src = steward_testenv::binaries::go_dir().join("leader-candidate");
            let started = Instant::now();
            let output = std::process::Command::new("go")
                .current_dir(&src)
                .args(["build", "-o"])
                .arg(&out)
                .arg(".")
                .output()
                .expect("run `go build` (is Go installed?)");
            assert!(
                output.status.success(),
                "go build in {} failed:\n{}",
                src.display(),
                String::from_utf8_lossy(&output.stderr)
            );
            eprintln!("built {} in {:?}", out.display(), started.elapsed());
            out
        })
        .clone()
}

#[tokio::test]
async fn one_of_three_leads_and_others_take_over_on_kill_and_term() {
    let _serial = SERIAL.lock().await;
    let mut e = Election::new("leader-three").await;
    let ids = ["rust-a", "rust-b", "rust-c"];
    for id in ids {
        e.start(Kind::Rust, id);
    }

    // Exactly one leads: it holds the Lease, and only it writes.
    let (first, acquired) = e.leader_among(&ids).await;
    e.first_write_after(&first, acquired).await;
    // Every follower has read the Lease held (so could have written wrongly since), and
    // the leader has had time for its ten writes.
    for id in ids.iter().filter(|id| **id != first) {
        e.follows(id).await;
    }
    at_least("the leader's tenth write", 10, WAIT, || {
        read_writes(&e.candidates[e.index_of(&first)].writes).len()
    })
    .await
    .unwrap();
    let lease = e.lease().await.expect("Lease");
    assert_eq!(
        lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref()),
        Some(first.as_str())
    );
    for c in &e.candidates {
        let writes = read_writes(&c.writes).len();
        if c.identity == first {
            assert!(
                writes >= 10,
                "the leader writes every 100 ms: {writes} writes"
            );
        } else {
            assert_eq!(
                writes,
                0,
                "{} is not the leader but wrote\n{}",
                c.identity,
                e.logs()
            );
        }
    }

    // SIGKILL the leader: another takes over once the Lease expires.
    let killed = e.candidates[e.index_of(&first)].signal("KILL");
    let rest: Vec<&str> = ids.iter().copied().filter(|id| *id != first).collect();
    let (second, acquired) = e.leader_among(&rest).await;
    let wrote = e.first_write_after(&second, killed).await;
    let failover = since(killed, acquired);
    eprintln!(
        "SIGKILL {first}: {second} acquired after {failover:?}, first write after {:?}",
        since(killed, wrote)
    );
    let bound = LEASE_DURATION + 2 * MAX_RETRY + SLACK;
    assert!(
        failover <= bound,
        "failover after SIGKILL took {failover:?} (bound {bound:?})"
    );
    assert!(
        failover >= LEASE_DURATION - 2 * RETRY_PERIOD,
        "took over before the lease expired: {failover:?}"
    );

    // SIGTERM the new leader: it releases the Lease and the last candidate takes over at its next retry.
    let terminated = e.candidates[e.index_of(&second)].signal("TERM");
    let last: Vec<&str> = rest.iter().copied().filter(|id| *id != second).collect();
    let (third, acquired) = e.leader_among(&last).await;
    let wrote = e.first_write_after(&third, terminated).await;
    let failover = since(terminated, acquired);
    eprintln!(
        "SIGTERM {second}: {third} acquired after {failover:?}, first write after {:?}",
        since(terminated, wrote)
    );
    let bound = MAX_RETRY + SLACK;
    assert!(
        failover <= bound,
        "failover after SIGTERM took {failover:?} (bound {bound:?})"
    );
    let index = e.index_of(&second);
    e.candidates[index]
        .exits_cleanly(Duration::from_secs(5))
        .await;

    let lease = e.lease().await.expect("Lease").spec.expect("spec");
    assert_eq!(lease.lease_transitions, Some(2), "two handovers");
    let terms = e.assert_terms_do_not_overlap();
    assert_eq!(terms.len(), 3, "{terms:?}");

    // Each acquisition and loss is an Event on the Lease.
    let events: Api<Event> = Api::namespaced(e.cp.client().expect("client"), &e.namespace);
    let notes = eventually("LeaderElection Events", WAIT, || async {
        let list = events
            .list(&Default::default())
            .await
            .map_err(|e| e.to_string())?;
        let notes: Vec<String> = list
            .items
            .into_iter()
            .filter(|ev| ev.reason.as_deref() == Some("LeaderElection"))
            .filter(|ev| {
                ev.regarding
                    .as_ref()
                    .is_some_and(|r| r.kind.as_deref() == Some("Lease"))
            })
            .filter_map(|ev| ev.note)
            .collect();
        let expected = [
            format!("{first} became leader"),
            format!("{second} became leader"),
            format!("{second} stopped leading"),
            format!("{third} became leader"),
        ];
        if expected.iter().all(|n| notes.contains(n)) {
            Ok(notes)
        } else {
            Err(format!("{notes:?}"))
        }
    })
    .await
    .expect("Events");
    eprintln!("Events: {notes:?}");
}

#[tokio::test]
async fn stopped_leader_does_not_write_after_waking() {
    let _serial = SERIAL.lock().await;
    let mut e = Election::new("leader-stop").await;
    let ids = ["rust-a", "rust-b"];
    for id in ids {
        e.start(Kind::Rust, id);
    }
    let (first, acquired) = e.leader_among(&ids).await;
    e.first_write_after(&first, acquired).await;
    let other = if first == ids[0] { ids[1] } else { ids[0] };

    // SIGSTOP the leader past the lease duration: the other candidate takes over.
    let stopped = e.candidates[e.index_of(&first)].signal("STOP");
    let (second, acquired) = e.leader_among(&[other]).await;
    e.first_write_after(&second, acquired).await;
    eprintln!(
        "SIGSTOP {first}: {second} acquired after {:?}",
        since(stopped, acquired)
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    // SIGCONT: the woken process must find its leadership stale and not write.
    let woken = e.candidates[e.index_of(&first)].signal("CONT");
    eprintln!("SIGCONT {first} after {:?} stopped", since(stopped, woken));
    tokio::time::sleep(LEASE_DURATION).await;

    let late: Vec<SystemTime> = read_writes(&e.candidates[e.index_of(&first)].writes)
        .into_iter()
        .map(|w| w.at)
        // A write already in flight when SIGSTOP lands may carry a time just after `stopped`
        // (the signal takes effect asynchronously); what must never happen is a write after
        // waking. Overlap with the new leader's term is checked separately below.
        .filter(|at| *at > woken)
        .collect();
    assert!(
        late.is_empty(),
        "{first} wrote {} times after waking (SIGCONT)\n{}",
        late.len(),
        e.logs()
    );
    let lease = e.lease().await.expect("Lease").spec.expect("spec");
    assert_eq!(
        lease.holder_identity.as_deref(),
        Some(second.as_str()),
        "the woken process did not take back the Lease"
    );
    let stderr =
        std::fs::read_to_string(&e.candidates[e.index_of(&first)].stderr).unwrap_or_default();
    let after_wake: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("stopped leading") || l.contains("skipped"))
        .collect();
    eprintln!("{first} after waking:\n  {}", after_wake.join("\n  "));
    assert!(
        stderr.contains("stopped leading"),
        "the woken process stepped down\n{}",
        e.logs()
    );
    e.assert_terms_do_not_overlap();
}

#[tokio::test]
async fn go_and_rust_candidates_take_over_from_each_other() {
    let _serial = SERIAL.lock().await;
    go_candidate(); // build before timing anything
    let mut e = Election::new("leader-go").await;

    // A client-go leader, a Rust follower. SIGKILL Go: Rust takes over the expired Lease.
    e.start(Kind::Go, "go-1");
    let (_, acquired) = e.leader_among(&["go-1"]).await;
    e.first_write_after("go-1", acquired).await;
    e.start(Kind::Rust, "rust-1");
    e.follows("rust-1").await;
    assert!(
        read_writes(&e.candidates[e.index_of("rust-1")].writes).is_empty(),
        "rust-1 follows\n{}",
        e.logs()
    );
    let killed = e.candidates[e.index_of("go-1")].signal("KILL");
    let (_, acquired) = e.leader_among(&["rust-1"]).await;
    e.first_write_after("rust-1", acquired).await;
    let failover = since(killed, acquired);
    eprintln!("SIGKILL go-1: rust-1 acquired after {failover:?}");
    assert!(
        failover <= LEASE_DURATION + 2 * MAX_RETRY + SLACK,
        "{failover:?}"
    );

    // SIGTERM the Rust leader: it releases, the Go follower takes over.
    e.start(Kind::Go, "go-2");
    e.follows("go-2").await;
    let terminated = e.candidates[e.index_of("rust-1")].signal("TERM");
    let (_, acquired) = e.leader_among(&["go-2"]).await;
    e.first_write_after("go-2", acquired).await;
    let failover = since(terminated, acquired);
    eprintln!("SIGTERM rust-1: go-2 acquired after {failover:?}");
    assert!(failover <= MAX_RETRY + SLACK, "{failover:?}");
    let index = e.index_of("rust-1");
    e.candidates[index]
        .exits_cleanly(Duration::from_secs(5))
        .await;

    // SIGTERM the Go leader: client-go releases, the Rust follower takes over.
    e.start(Kind::Rust, "rust-2");
    e.follows("rust-2").await;
    let terminated = e.candidates[e.index_of("go-2")].signal("TERM");
    let (_, acquired) = e.leader_among(&["rust-2"]).await;
    e.first_write_after("rust-2", acquired).await;
    let failover = since(terminated, acquired);
    eprintln!("SIGTERM go-2: rust-2 acquired after {failover:?}");
    assert!(failover <= MAX_RETRY + SLACK, "{failover:?}");
    let index = e.index_of("go-2");
    e.candidates[index]
        .exits_cleanly(Duration::from_secs(5))
        .await;

    // SIGKILL the Rust leader: the Go follower takes over the expired Lease.
    e.start(Kind::Go, "go-3");
    e.follows("go-3").await;
    let killed = e.candidates[e.index_of("rust-2")].signal("KILL");
    let (_, acquired) = e.leader_among(&["go-3"]).await;
    e.first_write_after("go-3", acquired).await;
    let failover = since(killed, acquired);
    eprintln!("SIGKILL rust-2: go-3 acquired after {failover:?}");
    assert!(
        failover <= LEASE_DURATION + 2 * MAX_RETRY + SLACK,
        "{failover:?}"
    );

    let lease = e.lease().await.expect("Lease").spec.expect("spec");
    assert_eq!(lease.lease_transitions, Some(4), "four handovers");
    let terms = e.assert_terms_do_not_overlap();
    let leaders: Vec<&str> = terms.iter().map(|t| t.identity.as_str()).collect();
    assert_eq!(leaders, ["go-1", "rust-1", "go-2", "rust-2", "go-3"]);
}

/// `with_lease_check` gates a take-over on the Lease as just read (issue #37: a PostgreSQL
/// replica eligible a moment before must not take a Lease released with a new clean-stop
/// record before it decided on that record). A candidate whose check refuses Leases annotated
/// `example.com/wait` does not take such a Lease when it is released, and takes it at its
/// next retry once the annotation is gone.
#[tokio::test]
async fn a_released_lease_is_taken_only_when_the_lease_check_accepts_it() {
    use kube::api::{Patch, PatchParams};
    use steward_core::leader::{LeaderElector, LeaseConfig};
    use tokio_util::sync::CancellationToken;

    let _serial = SERIAL.lock().await;
    let election = Election::new("leasecheck").await;
    let client = election.cp.client().expect("client");
    let config = |identity: &str| LeaseConfig {
        lease_name: LEASE.into(),
        namespace: election.namespace.clone(),
        identity: identity.into(),
        lease_duration: LEASE_DURATION,
        renew_deadline: RENEW_DEADLINE,
        retry_period: RETRY_PERIOD,
    };
    // A Lease released by "gone", carrying the record the check refuses.
    let lease: Lease = serde_json::from_value(serde_json::json!({
        "metadata": {"name": LEASE, "annotations": {"example.com/wait": "yes"}},
        "spec": {"holderIdentity": "", "leaseDurationSeconds": 1},
    }))
    .unwrap();
    election
        .leases
        .create(&Default::default(), &lease)
        .await
        .unwrap();
    // How often the elector asked its check about a Lease it could take.
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = asked.clone();
    let checked = LeaderElector::new(client.clone(), config("checked"))
        .unwrap()
        .with_lease_check(std::sync::Arc::new(move |lease: &Lease| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            !kube::ResourceExt::annotations(lease).contains_key("example.com/wait")
        }));
    let leadership = checked.leadership();
    let stop = CancellationToken::new();
    let task = tokio::spawn(checked.run(stop.clone()));
    // Three attempts to take the released Lease, each refused by the check.
    at_least("three take-over attempts", 3, WAIT, || {
        asked.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await
    .unwrap();
    let holder = election.lease().await.and_then(|l| l.spec?.holder_identity);
    assert_eq!(
        holder.as_deref(),
        Some(""),
        "refused by its check: still released"
    );
    assert!(!leadership.is_leader());
    let started = Instant::now();
    election
        .leases
        .patch(
            LEASE,
            &PatchParams::default(),
            &Patch::Merge(
                serde_json::json!({"metadata": {"annotations": {"example.com/wait": null}}}),
            ),
        )
        .await
        .unwrap();
    eventually("the checked candidate leads", WAIT, || async {
        leadership
            .is_leader()
            .then_some(())
            .ok_or_else(|| "not yet".to_string())
    })
    .await
    .unwrap();
    let took = started.elapsed();
    assert!(
        took <= MAX_RETRY + SLACK,
        "taken at its next retry once accepted ({took:?})"
    );
    stop.cancel();
    task.await.unwrap().unwrap();
}
