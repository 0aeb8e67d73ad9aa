//! No write of a former leader lands after another candidate could have taken over
//! (`steward_core::guard`, `steward_core::status`), and a released Lease is taken at once.
//!
//! The race is forced, not waited for: candidate A reaches the API server through a proxy
//! that can hold every byte in both directions (a network that delays, never drops), so a
//! write of A is in flight while A's renewals stall, A's leadership lapses and candidate B,
//! connected directly, takes over and writes. Then the held bytes are delivered. Each test
//! has a control write, sent the way an unfenced client would, that does land: it shows the
//! proxy really delivers late writes, so the fenced write's absence means something.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, CustomResource, CustomResourceExt, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use steward_core::leader::{LeaderElector, Leadership, LeaseConfig};
use steward_testenv::{ControlPlane, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, watch};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

/// The tests pause a candidate's network: run them one at a time.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// An object with a status subresource that nothing but these tests writes.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, JsonSchema)]
#[kube(
    group = "fence.test.steward.dev",
    version = "v1",
    kind = "FenceProbe",
    namespaced,
    status = "FenceProbeStatus"
)]
pub struct FenceProbeSpec {
    pub note: String,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize, JsonSchema)]
pub struct FenceProbeStatus {
    pub writer: String,
}

/// A TCP proxy to the API server. While held, bytes are read and kept, and delivered in order
/// once released; a side that closes is not passed on until the other side is done, so a
/// request whose client gave up still reaches the server whole, as on a slow network.
struct HoldingProxy {
    addr: SocketAddr,
    hold: watch::Sender<bool>,
    counts: Arc<Counts>,
}

/// What the proxy has in flight, so a test waits for the held bytes to have reached the
/// server and been answered instead of sleeping.
#[derive(Default)]
struct Counts {
    /// Chunks read from a client while held, not yet written to the server.
    held: AtomicUsize,
    /// Connections that delivered held bytes and have not heard from the server since.
    unanswered: AtomicUsize,
}

impl HoldingProxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (hold, held) = watch::channel(false);
        let counts = Arc::new(Counts::default());
        let all = counts.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let held = held.clone();
                let counts = all.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let awaiting = Arc::new(AtomicBool::new(false));
                    let tally = |upstream| Tally {
                        counts: counts.clone(),
                        awaiting: awaiting.clone(),
                        upstream,
                    };
                    let up =
                        tokio::spawn(pipe(client_read, server_write, held.clone(), tally(true)));
                    let down = tokio::spawn(pipe(server_read, client_write, held, tally(false)));
                    let _ = tokio::join!(up, down);
                });
            }
        });
        Self { addr, hold, counts }
    }

    /// Waits until every byte held has been delivered to the server and the server has
    /// answered (or closed) on each connection that carried some.
    async fn delivered_and_answered(&self) {
        eventually("the held bytes delivered and answered", WAIT, || async {
            let held = self.counts.held.load(Ordering::SeqCst);
            let unanswered = self.counts.unanswered.load(Ordering::SeqCst);
            if held == 0 && unanswered == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{held} chunks held, {unanswered} connections unanswered"
                ))
            }
        })
        .await
        .expect("the proxy delivers what it held");
    }

    fn hold(&self) {
        self.hold.send_replace(true);
    }

    fn release(&self) {
        self.hold.send_replace(false);
    }

    /// A client configuration for `cp` that goes through this proxy.
    fn config(&self, cp: &ControlPlane) -> kube::Config {
        let mut config = cp.config().clone();
        config.cluster_url = format!("https://{}", self.addr).parse().expect("proxy URL");
        config
    }
}

/// One [`pipe`]'s share of the proxy's [`Counts`]: which way it copies, and its connection's
/// mark "delivered held bytes the server has not answered yet" (set upstream, cleared
/// downstream when the server sends anything or closes).
struct Tally {
    counts: Arc<Counts>,
    awaiting: Arc<AtomicBool>,
    upstream: bool,
}

impl Tally {
    /// A chunk was read while `held` (or not): returns whether it is a held upstream chunk,
    /// counted until delivered. Anything read downstream is the server answering.
    fn read(&self, held: bool) -> bool {
        if !self.upstream {
            self.answered();
            return false;
        }
        if held {
            self.counts.held.fetch_add(1, Ordering::SeqCst);
        }
        held
    }

    /// A held chunk was written to the server (`ok`) or could not be.
    fn delivered(&self, ok: bool) {
        if ok && !self.awaiting.swap(true, Ordering::SeqCst) {
            self.counts.unanswered.fetch_add(1, Ordering::SeqCst);
        }
        self.counts.held.fetch_sub(1, Ordering::SeqCst);
    }

    /// The server sent something or closed (downstream only).
    fn answered(&self) {
        if !self.upstream && self.awaiting.swap(false, Ordering::SeqCst) {
            self.counts.unanswered.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Copies `from` to `to`, waiting while `held`; keeps `to` open (and the server's side of the
/// connection with it) for a while after `from` ended, so the last request is answered.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut held: watch::Receiver<bool>,
    tally: Tally,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let held_chunk = tally.read(*held.borrow());
        if held.wait_for(|h| !*h).await.is_err() {
            break;
        }
        let written = to.write_all(&buf[..n]).await;
        if held_chunk {
            tally.delivered(written.is_ok());
        }
        if written.is_err() {
            return;
        }
    }
    tally.answered();
    let _ = held.wait_for(|h| !*h).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let _ = to.shutdown().await;
}

/// A candidate on the Lease `lease`, stopped (and its Lease released) when dropped.
struct Candidate {
    leadership: Leadership,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Candidate {
    fn start(
        client: Client,
        namespace: &str,
        lease: &str,
        identity: &str,
        timings: [u64; 3],
    ) -> Self {
        let mut config = LeaseConfig::new(lease, namespace, identity.to_string());
        config.lease_duration = Duration::from_millis(timings[0]);
        config.renew_deadline = Duration::from_millis(timings[1]);
        config.retry_period = Duration::from_millis(timings[2]);
        let elector = LeaderElector::new(client, config).expect("valid lease timings");
        let leadership = elector.leadership();
        let stop = CancellationToken::new();
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let _ = elector.run(token).await;
        });
        Self {
            leadership,
            stop,
            task: Some(task),
        }
    }

    async fn leads(&self, who: &str) {
        tokio::time::timeout(WAIT, self.leadership.acquired())
            .await
            .unwrap_or_else(|_| panic!("{who} did not become leader within {WAIT:?}"));
    }

    /// Stops gracefully: the Lease is released.
    async fn shut_down(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Candidate {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// 4 s lease, 3 s renew deadline, 0.5 s retry period.
const FAST: [u64; 3] = [4000, 3000, 500];

struct Setup {
    cp: &'static ControlPlane,
    namespace: String,
    proxy: HoldingProxy,
    /// Leads first, through the proxy (its renewals are held with its writes).
    a: Candidate,
    /// Takes over, connected directly.
    b: Candidate,
}

async fn setup(prefix: &str) -> Setup {
    let cp = steward_testenv::shared().await.expect("control plane");
    let namespace = cp.namespace(prefix).await.expect("namespace");
    let upstream: SocketAddr = cp
        .apiserver_url()
        .trim_start_matches("https://")
        .parse()
        .expect("API server address");
    let proxy = HoldingProxy::start(upstream).await;
    let through_proxy = Client::try_from(proxy.config(cp)).expect("client via proxy");
    let a = Candidate::start(through_proxy, &namespace, "fenced", "a", FAST);
    a.leads("a").await;
    let b = Candidate::start(
        cp.client().expect("client"),
        &namespace,
        "fenced",
        "b",
        FAST,
    );
    Setup {
        cp,
        namespace,
        proxy,
        a,
        b,
    }
}

fn config_map(name: &str, value: &str) -> ConfigMap {
    let mut cm = ConfigMap::default();
    cm.metadata.name = Some(name.into());
    cm.data = Some([("writer".to_string(), value.to_string())].into());
    cm
}

/// A write of the old leader that is still waiting for its connection when leadership lapses
/// is never sent: the caller hears that it may not have landed, and it never does, while an
/// unfenced write held the same way lands when the network lets it through.
#[tokio::test]
async fn a_write_held_in_flight_past_the_lease_never_lands() {
    let _serial = SERIAL.lock().await;
    let s = setup("fence-flight").await;
    // Fresh clients: no pooled connection, so each write waits for its TLS handshake.
    let guarded = steward_core::guard::client(s.proxy.config(s.cp), s.a.leadership.clone())
        .expect("guarded client");
    let unfenced = Client::try_from(s.proxy.config(s.cp)).expect("unfenced client");
    let guarded_cms: Api<ConfigMap> = Api::namespaced(guarded, &s.namespace);
    let unfenced_cms: Api<ConfigMap> = Api::namespaced(unfenced, &s.namespace);

    s.proxy.hold();
    assert!(
        s.a.leadership.is_leader(),
        "a leads when its writes are sent"
    );
    let fenced_write = tokio::spawn(async move {
        guarded_cms
            .create(&PostParams::default(), &config_map("from-old-leader", "a"))
            .await
    });
    let control_write = tokio::spawn(async move {
        unfenced_cms
            .create(&PostParams::default(), &config_map("control", "a"))
            .await
    });

    let outcome = tokio::time::timeout(WAIT, fenced_write)
        .await
        .expect("the fenced write is abandoned when leadership lapses")
        .expect("join");
    let err = outcome.expect_err("the fenced write cannot succeed while its bytes are held");
    let text = steward_core::chain(&err);
    assert!(
        text.contains("may or may not have been applied"),
        "the caller is told the write is unconfirmed: {text}"
    );
    s.b.leads("b").await;
    s.proxy.release();

    let cms: Api<ConfigMap> = Api::namespaced(s.cp.client().expect("client"), &s.namespace);
    tokio::time::timeout(WAIT, control_write)
        .await
        .expect("the control write completes once released")
        .expect("join")
        .expect("the unfenced control write lands after the takeover");
    eventually("the control write is visible", WAIT, || async {
        cms.get_opt("control")
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "not there yet".to_string())
    })
    .await
    .expect("control write");
    // Whatever of the fenced request had reached the proxy was delivered with the control,
    // and the server has answered it.
    s.proxy.delivered_and_answered().await;
    assert!(
        cms.get_opt("from-old-leader").await.expect("get").is_none(),
        "the old leader's write landed after b took over"
    );
}

/// A status write of the old leader whose bytes already left (a pooled connection) reaches
/// the server after the new leader wrote: the resourceVersion precondition makes the server
/// refuse it. The same late write without the precondition overwrites the new leader's.
#[tokio::test]
async fn a_late_status_write_of_the_old_leader_is_refused_by_the_server() {
    let _serial = SERIAL.lock().await;
    let s = setup("fence-status").await;
    s.cp.apply_crd(&FenceProbe::crd()).await.expect("CRD");
    let direct: Api<FenceProbe> = Api::namespaced(s.cp.client().expect("client"), &s.namespace);
    for name in ["probe", "control"] {
        direct
            .create(
                &PostParams::default(),
                &FenceProbe::new(name, FenceProbeSpec { note: name.into() }),
            )
            .await
            .expect("create probe");
    }
    let guarded = steward_core::guard::client(s.proxy.config(s.cp), s.a.leadership.clone())
        .expect("guarded client");
    let old: Api<FenceProbe> = Api::namespaced(guarded, &s.namespace);
    let unfenced: Api<FenceProbe> = Api::namespaced(
        Client::try_from(s.proxy.config(s.cp)).expect("unfenced client"),
        &s.namespace,
    );
    // What the old leader read, each client with a connection in its pool to send on.
    let probe = old.get("probe").await.expect("read probe");
    let control = unfenced.get("control").await.expect("read control");

    s.proxy.hold();
    let status = |writer: &str| FenceProbeStatus {
        writer: writer.into(),
    };
    let api = old.clone();
    let fenced_write = tokio::spawn(async move {
        steward_core::status::apply(&api, &probe, None, &status("a"), "steward-test").await
    });
    let api = unfenced.clone();
    let control_write = tokio::spawn(async move {
        // Unconditional, as status writes were before the precondition.
        let patch = serde_json::json!({
            "apiVersion": "fence.test.steward.dev/v1", "kind": "FenceProbe",
            "status": {"writer": "a"},
        });
        api.patch_status(
            &control.name_any(),
            &PatchParams::apply("steward-test").force(),
            &Patch::Apply(&patch),
        )
        .await
    });
    let abandoned = tokio::time::timeout(WAIT, fenced_write)
        .await
        .expect("abandoned when leadership lapses")
        .expect("join");
    assert!(abandoned.is_err(), "unanswered: {abandoned:?}");

    s.b.leads("b").await;
    for name in ["probe", "control"] {
        let current = direct.get(name).await.expect("read as b");
        let written =
            steward_core::status::apply(&direct, &current, None, &status("b"), "steward-test")
                .await
                .expect("b writes status");
        assert!(written, "b's status write of {name} happened");
    }
    s.proxy.release();

    // The held requests reach the server now; the control overwrites b's status.
    eventually("the control's late write lands", WAIT, || async {
        let probe = direct.get("control").await.map_err(|e| e.to_string())?;
        match probe.status {
            Some(status) if status.writer == "a" => Ok(()),
            other => Err(format!("status is {other:?}")),
        }
    })
    .await
    .expect("the unconditional late write overwrote b's status (the proxy delivers)");
    let _ = control_write.await;
    s.proxy.delivered_and_answered().await;
    let probe = direct.get("probe").await.expect("read probe");
    assert_eq!(
        probe.status.map(|s| s.writer).as_deref(),
        Some("b"),
        "the old leader's conditional status write overwrote the new leader's"
    );
}

/// A follower takes a released Lease as soon as the watch shows it, not at its next poll:
/// with a 30 s retry period, polling alone could take up to 45 s.
#[tokio::test]
async fn a_released_lease_is_taken_at_once() {
    let _serial = SERIAL.lock().await;
    let cp = steward_testenv::shared().await.expect("control plane");
    let namespace = cp.namespace("fence-release").await.expect("namespace");
    let slow = [60_000, 40_000, 30_000];
    let a = Candidate::start(
        cp.client().expect("client"),
        &namespace,
        "released",
        "a",
        slow,
    );
    a.leads("a").await;
    let b = Candidate::start(
        cp.client().expect("client"),
        &namespace,
        "released",
        "b",
        slow,
    );
    // b has read the Lease held by a (its first attempt) before a lets go.
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(cp.client().expect("client"), &namespace);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let released = std::time::Instant::now();
    a.shut_down().await;
    tokio::time::timeout(Duration::from_secs(10), b.leadership.acquired())
        .await
        .expect("b takes the released Lease well before its next poll (30–45 s)");
    let taken = released.elapsed();
    let holder = leases
        .get("released")
        .await
        .expect("lease")
        .spec
        .and_then(|s| s.holder_identity);
    assert_eq!(holder.as_deref(), Some("b"));
    eprintln!("released lease taken {taken:?} after a's shutdown began");
}
