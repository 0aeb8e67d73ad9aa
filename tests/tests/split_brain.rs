//! Split-brain torture: three tenant-operator processes share one Lease (4 s / 3 s / 1 s) under
//! constant Tenant churn while the leader is, in turn, paused past its lease (SIGSTOP, then
//! SIGCONT once another replica leads), SIGKILLed or SIGTERMed (and restarted). The API
//! server's audit log records every write with the replica (its own ServiceAccount) that made
//! it and the Lease writes with the holder each one claimed.
//!
//! Invariant: no replica's write is received by the API server while another replica holds
//! the Lease, and none is still in flight when another replica takes it over. After the
//! rounds, every Tenant converges.
//!
//! By default 6 rounds (two of each signal); `STEWARD_SPLIT_BRAIN_ROUNDS=180` for the long run.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::CustomResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use steward_testenv::{ControlPlane, Options, eventually};
use tenant_operator::crd::Tenant;
use tokio::process::{Child, Command};

const NAMESPACE: &str = "split-brain";
const REPLICAS: usize = 3;
const TENANTS: usize = 20;
const WAIT: Duration = Duration::from_secs(60);

fn rounds() -> usize {
    std::env::var("STEWARD_SPLIT_BRAIN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

struct Replica {
    index: usize,
    child: Child,
    kubeconfig: PathBuf,
    log: PathBuf,
}

impl Replica {
    fn spawn(binary: &Path, index: usize, kubeconfig: PathBuf, dir: &Path) -> Self {
        let log = dir.join(format!("replica-{index}.log"));
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(binary)
            .args([
                "--kubeconfig",
                &kubeconfig.display().to_string(),
                "--leader-elect=true",
                "--leader-election-namespace",
                NAMESPACE,
                "--leader-election-lease-duration=4s",
                "--leader-election-renew-deadline=3s",
                "--leader-election-retry-period=1s",
                "--metrics-bind-address=0",
                "--health-probe-bind-address=0",
                "--shutdown-timeout=5s",
                "--log-level=info",
            ])
            .env("POD_NAME", format!("replica-{index}"))
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .expect("start a tenant-operator replica");
        Self {
            index,
            child,
            kubeconfig,
            log,
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} replica-{}", self.index);
    }
}

/// A kubeconfig for `cp` authenticated with `token`.
fn kubeconfig(cp: &ControlPlane, token: &str, path: &Path) -> PathBuf {
    let mut config = kube::config::Kubeconfig::read_from(cp.kubeconfig_path()).unwrap();
    for named in &mut config.auth_infos {
        named.auth_info = Some(kube::config::AuthInfo {
            token: Some(token.to_string().into()),
            ..Default::default()
        });
    }
    std::fs::write(path, serde_yaml::to_string(&config).unwrap()).unwrap();
    path.to_path_buf()
}

/// The current holder's replica index, from its identity `replica-<i>_<hex>`.
async fn leader(leases: &Api<Lease>) -> Option<(usize, String)> {
    let holder = leases
        .get_opt(tenant_operator::NAME)
        .await
        .ok()??
        .spec?
        .holder_identity?;
    let index = holder
        .strip_prefix("replica-")?
        .split('_')
        .next()?
        .parse()
        .ok()?;
    Some((index, holder))
}

async fn new_leader(leases: &Api<Lease>, old: &str) -> (usize, String) {
    eventually("another replica leads", WAIT, || async {
        match leader(leases).await {
            Some((i, holder)) if holder != old => Ok((i, holder)),
            other => Err(format!("holder {other:?}")),
        }
    })
    .await
    .expect("a takeover")
}

async fn tenants_converged(tenants: &Api<Tenant>) -> Result<(), String> {
    let list = tenants
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    let ready = list
        .items
        .iter()
        .filter(|t| {
            let s = t.status.clone().unwrap_or_default();
            s.observed_generation == t.metadata.generation
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
        .count();
    if ready == TENANTS {
        Ok(())
    } else {
        Err(format!(
            "{ready}/{TENANTS} Tenants Ready at their generation"
        ))
    }
}

/// One audited request.
#[derive(Debug)]
struct Audited {
    user: String,
    verb: String,
    what: String,
    code: i64,
    received: String,
    completed: String,
    /// For Lease writes: the holder the request claimed.
    holder: Option<String>,
}

fn read_audit(path: &Path) -> Vec<Audited> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| e["stage"] == "ResponseComplete")
        .map(|e| {
            let r = &e["objectRef"];
            let what = format!(
                "{}/{}/{}{}",
                r["resource"].as_str().unwrap_or_default(),
                r["namespace"].as_str().unwrap_or_default(),
                r["name"].as_str().unwrap_or_default(),
                r["subresource"]
                    .as_str()
                    .map(|s| format!("/{s}"))
                    .unwrap_or_default()
            );
            Audited {
                user: e["user"]["username"].as_str().unwrap_or_default().into(),
                verb: e["verb"].as_str().unwrap_or_default().into(),
                what,
                code: e["responseStatus"]["code"].as_i64().unwrap_or(0),
                received: e["requestReceivedTimestamp"]
                    .as_str()
                    .unwrap_or_default()
                    .into(),
                completed: e["stageTimestamp"].as_str().unwrap_or_default().into(),
                holder: e["requestObject"]["spec"]["holderIdentity"]
                    .as_str()
                    .map(String::from),
            }
        })
        .collect()
}

/// Writes of replicas that the API server received while another replica held the Lease
/// (`definite`), or that were in flight across a takeover by another replica (`straddling`).
fn violations(events: &[Audited], lease: &str) -> (Vec<String>, Vec<String>, usize, usize) {
    let replica =
        |user: &str| user.starts_with(&format!("system:serviceaccount:{NAMESPACE}:replica-"));
    // Successful Lease writes in commit order: (completed, holder, writer).
    let mut terms: Vec<(&str, &str, &str)> = events
        .iter()
        .filter(|e| {
            e.what == lease && e.code < 300 && matches!(e.verb.as_str(), "create" | "update")
        })
        .map(|e| {
            (
                e.completed.as_str(),
                e.holder.as_deref().unwrap_or_default(),
                e.user.as_str(),
            )
        })
        .collect();
    terms.sort_unstable();
    // Which replica (user) each holder identity is.
    let user_of: BTreeMap<&str, &str> = terms
        .iter()
        .filter(|(_, holder, _)| !holder.is_empty())
        .map(|(_, holder, user)| (*holder, *user))
        .collect();
    let holder_at = |t: &str| -> Option<&str> {
        terms
            .iter()
            .take_while(|(at, _, _)| *at <= t)
            .last()
            .and_then(|(_, holder, _)| user_of.get(holder).copied())
    };
    let takeovers = terms
        .windows(2)
        .filter(|w| !w[1].1.is_empty() && w[0].1 != w[1].1)
        .count();
    let (mut definite, mut straddling, mut checked) = (Vec::new(), Vec::new(), 0);
    for e in events.iter().filter(|e| {
        replica(&e.user)
            && e.code < 400
            && !e.what.starts_with("leases/")
            && !e.what.starts_with("events/")
    }) {
        checked += 1;
        if holder_at(&e.received) != Some(e.user.as_str()) {
            definite.push(format!("{e:?} (holder then: {:?})", holder_at(&e.received)));
        } else if terms.iter().any(|(at, holder, _)| {
            *at > e.received.as_str()
                && *at <= e.completed.as_str()
                && user_of.get(holder).is_some_and(|u| *u != e.user)
        }) {
            straddling.push(format!("{e:?}"));
        }
    }
    (definite, straddling, checked, takeovers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_write_lands_outside_its_writers_term() {
    let cp = ControlPlane::start(Options {
        nodes: 1,
        audit: true,
        ..Options::default()
    })
    .await
    .expect("control plane");
    let client = cp.client().unwrap();
    cp.apply_crd(&Tenant::crd()).await.expect("Tenant CRD");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).unwrap(),
        )
        .await
        .unwrap();
    let binary = steward_testenv::harness::cargo_build()
        .expect("build the tenant-operator")
        .join("tenant-operator");
    let dir = cp.dir().to_path_buf();
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let name = format!("replica-{i}");
        let token = cp.service_account_token(NAMESPACE, &name).await.unwrap();
        bindings
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("split-brain-{name}")},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
                    "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}],
                }))
                .unwrap(),
            )
            .await
            .unwrap();
        let config = kubeconfig(&cp, &token, &dir.join(format!("{name}.kubeconfig")));
        replicas.push(Replica::spawn(&binary, i, config, &dir));
    }

    let tenants: Api<Tenant> = Api::all(client.clone());
    for i in 0..TENANTS {
        let t: Tenant = serde_json::from_value(json!({
            "apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant",
            "metadata": {"name": format!("sb{i:02}")},
            "spec": {
                "owners": [{"kind": "User", "name": format!("owner-{i}")}],
                "namespaces": [format!("sb{i:02}-ns")],
                "resourceQuota": {"hard": {"pods": 10}},
            },
        }))
        .unwrap();
        tenants.create(&PostParams::default(), &t).await.unwrap();
    }
    eventually("Tenants Ready", Duration::from_secs(180), || {
        tenants_converged(&tenants)
    })
    .await
    .expect("initial convergence");

    // Churn: one Tenant's quota changes every 50 ms, so the leader always has writes to make.
    let churn_stop = tokio_util::sync::CancellationToken::new();
    let churn = tokio::spawn({
        let tenants = tenants.clone();
        let stop = churn_stop.clone();
        async move {
            let mut n = 0u32;
            while !stop.is_cancelled() {
                let name = format!("sb{:02}", n as usize % TENANTS);
                let patch = json!({"spec": {"resourceQuota": {"hard": {"pods": 11 + n % 50}}}});
                let _ = tenants
                    .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                    .await;
                n += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });

    let leases: Api<Lease> = Api::namespaced(client.clone(), NAMESPACE);
    let binary_for_restart = binary.clone();
    let rounds = rounds();
    for round in 0..rounds {
        let (index, holder) = eventually("a leader", WAIT, || async {
            leader(&leases).await.ok_or("no holder".to_string())
        })
        .await
        .expect("a leader");
        let signal = ["STOP", "KILL", "TERM"][round % 3];
        replicas[index].signal(signal);
        let (next, _) = new_leader(&leases, &holder).await;
        assert_ne!(next, index, "round {round}: another replica took over");
        if signal == "STOP" {
            // Woken after the takeover: it must notice and write nothing.
            replicas[index].signal("CONT");
        } else {
            let _ = replicas[index].child.wait().await;
            let kubeconfig = replicas[index].kubeconfig.clone();
            replicas[index] = Replica::spawn(&binary_for_restart, index, kubeconfig, &dir);
        }
        eprintln!("round {round}: SIG{signal} replica-{index}; replica-{next} leads");
        // Let the new leader work (and the woken one run) before the next round.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    churn_stop.cancel();
    churn.await.unwrap();
    eventually(
        "Tenants converge after the torture",
        Duration::from_secs(120),
        || tenants_converged(&tenants),
    )
    .await
    .expect("every Tenant converged");
    for replica in &mut replicas {
        replica.signal("TERM");
        let _ = tokio::time::timeout(Duration::from_secs(15), replica.child.wait()).await;
    }

    let events = read_audit(&cp.audit_log().expect("audit log"));
    let lease = format!("leases/{NAMESPACE}/{}", tenant_operator::NAME);
    let (definite, straddling, checked, takeovers) = violations(&events, &lease);
    eprintln!(
        "SPLIT BRAIN: {rounds} rounds, {takeovers} takeovers, {checked} replica writes checked, {} outside their writer's term, {} in flight across a takeover",
        definite.len(),
        straddling.len()
    );
    assert!(
        takeovers >= rounds,
        "every round changed the leader ({takeovers} takeovers)"
    );
    assert!(checked > 0, "the replicas wrote");
    assert!(
        definite.is_empty() && straddling.is_empty(),
        "writes outside their writer's term:\n{}\nin flight across a takeover:\n{}\nlogs: {}",
        definite.join("\n"),
        straddling.join("\n"),
        replicas[0].log.parent().unwrap().display()
    );
}

/// The checker itself: a write received after another replica's takeover, and one in flight
/// across it, are both reported; writes inside their writer's term are not.
#[test]
fn the_checker_finds_writes_outside_a_term() {
    let user = |i: usize| format!("system:serviceaccount:{NAMESPACE}:replica-{i}");
    let lease = format!("leases/{NAMESPACE}/{}", tenant_operator::NAME);
    let write =
        |i: usize, what: &str, received: &str, completed: &str, holder: Option<&str>| Audited {
            user: user(i),
            verb: if holder.is_some() { "update" } else { "patch" }.into(),
            what: what.into(),
            code: 200,
            received: received.into(),
            completed: completed.into(),
            holder: holder.map(String::from),
        };
    let t = |s: u32| format!("2026-12-01T00:00:{s:02}.000000Z");
    let events = vec![
        write(0, &lease, &t(1), &t(1), Some("replica-0_a")),
        write(0, "resourcequotas/ns/q", &t(2), &t(2), None),
        write(1, &lease, &t(6), &t(6), Some("replica-1_b")),
        // replica-0 again, after replica-1 took over: outside its term.
        write(0, "resourcequotas/ns/q", &t(7), &t(7), None),
        // replica-1, received in its term.
        write(1, "resourcequotas/ns/q", &t(8), &t(8), None),
        // replica-1, in flight while replica-0 takes the Lease back.
        write(1, "resourcequotas/ns/r", &t(9), &t(11), None),
        write(0, &lease, &t(10), &t(10), Some("replica-0_c")),
    ];
    let (definite, straddling, checked, takeovers) = violations(&events, &lease);
    assert_eq!((checked, takeovers), (4, 2));
    assert_eq!(definite.len(), 1, "{definite:?}");
    assert!(definite[0].contains(&t(7)), "{definite:?}");
    assert_eq!(straddling.len(), 1, "{straddling:?}");
    assert!(
        straddling[0].contains("resourcequotas/ns/r"),
        "{straddling:?}"
    );
}
