//! Several real nodes on one host (`Options::real_nodes`): each node's kubelet, containerd and
//! kube-proxy in a network namespace of its own, in a zone of its own, its pods in a network
//! of its own, routed through the host; and the faults a production cluster sees most: a node
//! that loses power, a node cut off from the network, a drain through a PodDisruptionBudget.
//!
//! One control plane with three nodes goes through them in turn (a control plane and its
//! nodes start in about 9 s); the machine runs one set of real nodes at a time ([`NODES`]).
//! Needs root.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use steward_testenv::NODE_MONITOR_GRACE;
use steward_testenv::node::teardown::leftovers;
use steward_testenv::{ControlPlane, eventually};

#[path = "support/real_node.rs"]
mod support;
use support::{WAIT, get, logs, rand_u32, service, start_nodes as start};

/// One set of real nodes at a time; the teardown check sees only what its own nodes left.
static NODES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a node may take to be marked `NotReady` after its last heartbeat: the grace
/// period, plus one Lease renewal (5 s) the stopped kubelet may have just done, plus two of the
/// controller manager's 2 s checks, plus 5 s for a loaded machine.
const NOT_READY_WITHIN: Duration = Duration::from_secs(NODE_MONITOR_GRACE.as_secs() + 5 + 4 + 5);

/// The busybox image, imported into every node.
async fn busybox(cp: &ControlPlane) -> String {
    let mut image = String::new();
    for node in cp.real_nodes() {
        image = node.busybox_image().await.expect("busybox image");
    }
    image
}

/// A web server on node `node` answering `token` on port 8080, labelled `app: web`.
fn web(name: &str, image: &str, node: &str, token: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Never",
                "command": ["sh", "-c", format!("mkdir -p /www && echo {token} > /www/index.html && exec httpd -f -p 8080 -h /www")],
            }],
        }
    }))
    .unwrap()
}

/// The pod's IP once it runs with it.
async fn running_ip(pods: &Api<Pod>, name: &str) -> String {
    running_ip_after(pods, name, None).await.0
}

/// The pod's IP and its container's id once it runs, in a container other than `before` (a
/// pod whose node comes back runs in a new sandbox, with a new address; until kubelet says so
/// its status is the one from before).
async fn running_ip_after(
    pods: &Api<Pod>,
    name: &str,
    before: Option<&str>,
) -> (String, Option<String>) {
    eventually(&format!("pod {name} Running"), WAIT, || async move {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        let status = pod.status.unwrap_or_default();
        let containers = status.container_statuses.unwrap_or_default();
        let ready = !containers.is_empty() && containers.iter().all(|c| c.ready);
        let id = containers.first().and_then(|c| c.container_id.clone());
        let new = before.is_none() || id.as_deref() != before;
        match (status.phase.as_deref(), status.pod_ip) {
            (Some("Running"), Some(ip)) if ready && new => Ok((ip, id.clone())),
            (phase, ip) => Err(format!(
                "phase {phase:?}, IP {ip:?}, ready {ready}, container {id:?}"
            )),
        }
    })
    .await
    .unwrap()
}

/// Whether node `name` is Ready (its `Ready` condition `True`).
async fn ready(client: &Client, name: &str) -> bool {
    Api::<Node>::all(client.clone())
        .get(name)
        .await
        .ok()
        .and_then(|n| n.status)
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Waits until node `name` is (`want`) or is not Ready; returns how long that took.
async fn until_ready(client: &Client, name: &str, want: bool, within: Duration) -> Duration {
    let started = Instant::now();
    eventually(
        &format!("node {name} Ready={want}"),
        within,
        || async move {
            if ready(client, name).await == want {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await
    .unwrap();
    started.elapsed()
}

/// Three nodes, one control plane, in turn: the nodes serve each other and the host, a node is
/// cut off and healed, a node loses power and comes back, a drain waits for a budget; the
/// sharded tenant-operator, one replica per node, loses the leader's node; then the host is
/// clean.
#[tokio::test]
async fn three_nodes_in_zones_are_cut_off_lose_power_and_are_drained_as_real_ones() {
    let _turn = NODES.lock().await;
    let mut cp = start(3).await;
    let client = cp.client().unwrap();
    let image = busybox(&cp).await;
    serve_each_other_and_the_host_through_a_service(&cp, &client, &image).await;
    a_partitioned_node_goes_not_ready_and_a_drain_waits_for_the_disruption_budget(
        &cp, &client, &image,
    )
    .await;
    a_node_that_loses_power_goes_not_ready_and_runs_its_pods_again_when_it_is_back(
        &mut cp, &client, &image,
    )
    .await;
    the_sharded_tenant_operator_spreads_over_the_nodes_and_a_lost_node_moves_only_its_shards(
        &mut cp, &client,
    )
    .await;
    let during = leftovers();
    for kind in [
        "netns /run/netns/steward-node-",
        "bridge steward-link",
        "veth stw-node-",
    ] {
        assert!(
            during.iter().any(|l| l.contains(kind)),
            "running nodes have a {kind} (else the check below proves nothing): {during:#?}"
        );
    }
    drop(cp);
    let left = leftovers();
    assert!(left.is_empty(), "left on the host: {left:#?}");
}

/// Nodes in zones of their own; pods of each node reach each other, the host and Services
/// (by DNS name too) across nodes.
async fn serve_each_other_and_the_host_through_a_service(
    cp: &ControlPlane,
    client: &Client,
    image: &str,
) {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    let mut zones: Vec<(String, String)> = nodes
        .items
        .iter()
        .map(|n| {
            (
                n.name_any(),
                n.labels()
                    .get("topology.kubernetes.io/zone")
                    .cloned()
                    .unwrap_or_default(),
            )
        })
        .collect();
    zones.sort();
    assert_eq!(
        zones,
        (0..3)
            .map(|i| (format!("steward-node-{i}"), format!("zone-{i}")))
            .collect::<Vec<_>>(),
        "three nodes, each in a zone of its own"
    );

    let ns = cp.namespace("rns-net").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let tokens: Vec<String> = (0..3)
        .map(|i| format!("token-{i}-{:08x}", rand_u32()))
        .collect();
    for (i, node) in cp.real_nodes().iter().enumerate() {
        pods.create(
            &PostParams::default(),
            &web(&format!("web-{i}"), image, node.name(), &tokens[i]),
        )
        .await
        .unwrap();
    }
    let cluster_ip = service(cp, &ns, "web", 80, 8080).await;
    let mut ips = Vec::new();
    for i in 0..3 {
        let ip = running_ip(&pods, &format!("web-{i}")).await;
        // Each node's pods in its own network.
        assert!(
            ip.starts_with(&format!("198.18.{}.", i + 1)),
            "web-{i} on steward-node-{i} has {ip}"
        );
        ips.push(ip);
    }
    // The host reaches every node's pods, directly and through the Service (its own
    // kube-proxy), which answers from all three nodes.
    for (ip, token) in ips.iter().zip(&tokens) {
        let page = eventually(&format!("GET {ip}:8080"), WAIT, || get(ip, 8080))
            .await
            .unwrap();
        assert!(page.contains(token), "{ip} answered {page}");
    }
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    eventually("the Service answers from every node", WAIT, || async {
        let page = get(&cluster_ip, 80).await.unwrap_or_default();
        let mut seen = seen.lock().map_err(|e| e.to_string())?;
        seen.extend(tokens.iter().filter(|t| page.contains(*t)).cloned());
        if seen.len() == tokens.len() {
            Ok(())
        } else {
            Err(format!("answers from {seen:?} so far"))
        }
    })
    .await
    .unwrap();

    // A pod on node 0 reaches a pod on node 2 by its IP, and the Service by its DNS name (the
    // host's CoreDNS, node 0's kube-proxy).
    let name = format!("web.{ns}.svc.cluster.local");
    let script = format!(
        "for i in $(seq 1 100); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip2} 8080 | grep -q {token2} && break; sleep 0.3; done; \
         printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip2} 8080 | grep -q {token2} || exit 1; echo reached {token2}; \
         ip=$(nslookup {name} | awk '/^Address: /{{print $2}}' | tail -1); echo resolved $ip; \
         for i in $(seq 1 100); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 $ip 80 | grep -q token- && echo through the Service && exit 0; sleep 0.3; done; exit 1",
        ip2 = ips[2],
        token2 = tokens[2],
    );
    let client_pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "steward-node-0"},
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", script]}],
        }
    }))
    .unwrap();
    pods.create(&PostParams::default(), &client_pod)
        .await
        .unwrap();
    let phase = eventually("the client pod finished", WAIT, || async {
        let pod = pods.get("client").await.map_err(|e| e.to_string())?;
        match pod.status.and_then(|s| s.phase).as_deref() {
            Some(p @ ("Succeeded" | "Failed")) => Ok(p.to_string()),
            other => Err(format!("phase {other:?}")),
        }
    })
    .await
    .unwrap();
    let text = logs(&pods, "client").await;
    assert_eq!(phase, "Succeeded", "client log:\n{text}");
    assert!(text.contains(&format!("resolved {cluster_ip}")), "{text}");
    assert!(text.contains("through the Service"), "{text}");
}

async fn a_node_that_loses_power_goes_not_ready_and_runs_its_pods_again_when_it_is_back(
    cp: &mut ControlPlane,
    client: &Client,
    image: &str,
) {
    let ns = cp.namespace("rns-power").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let token = format!("token-{:08x}", rand_u32());
    pods.create(
        &PostParams::default(),
        &web("web", image, "steward-node-2", &token),
    )
    .await
    .unwrap();
    let (ip, container) = running_ip_after(&pods, "web", None).await;
    eventually("the web pod answers", WAIT, || get(&ip, 8080))
        .await
        .unwrap();

    let stopped = Instant::now();
    cp.real_node_mut(2).unwrap().stop().unwrap();
    // Its pods died with it, at once.
    assert!(
        get(&ip, 8080).await.is_err(),
        "the pod's server still answers after its node lost power"
    );
    until_ready(client, "steward-node-2", false, NOT_READY_WITHIN).await;
    eprintln!(
        "steward-node-2 NotReady {:.1?} after it lost power (grace {NODE_MONITOR_GRACE:?})",
        stopped.elapsed()
    );
    // The other nodes are untouched.
    for other in ["steward-node-0", "steward-node-1"] {
        assert!(ready(client, other).await, "{other} Ready");
    }

    let back = Instant::now();
    cp.real_node_mut(2)
        .unwrap()
        .start_again(client, WAIT)
        .await
        .unwrap();
    until_ready(client, "steward-node-2", true, WAIT).await;
    // kubelet finds the pod bound to it and starts it again (a new sandbox, a new address).
    let (ip, _) = running_ip_after(&pods, "web", container.as_deref()).await;
    let page = eventually("the web pod answers again", WAIT, || get(&ip, 8080))
        .await
        .unwrap();
    assert!(page.contains(&token), "{page}");
    eprintln!(
        "steward-node-2 Ready and its pod answering {:.1?} after it was started again",
        back.elapsed()
    );
}

async fn a_partitioned_node_goes_not_ready_and_a_drain_waits_for_the_disruption_budget(
    cp: &ControlPlane,
    client: &Client,
    image: &str,
) {
    let ns = cp.namespace("rns-cut").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);

    // Cut off: its pod unreachable, the node NotReady; healed: back.
    let token = format!("token-{:08x}", rand_u32());
    pods.create(
        &PostParams::default(),
        &web("web", image, "steward-node-1", &token),
    )
    .await
    .unwrap();
    let ip = running_ip(&pods, "web").await;
    eventually("the web pod answers", WAIT, || get(&ip, 8080))
        .await
        .unwrap();
    let node = &cp.real_nodes()[1];
    let cut = Instant::now();
    node.partition().unwrap();
    assert!(
        get(&ip, 8080).await.is_err(),
        "a pod on a partitioned node still answers"
    );
    until_ready(client, "steward-node-1", false, NOT_READY_WITHIN).await;
    eprintln!(
        "steward-node-1 NotReady {:.1?} after it was cut off",
        cut.elapsed()
    );
    node.heal().unwrap();
    until_ready(client, "steward-node-1", true, WAIT).await;
    let page = eventually("the web pod answers once healed", WAIT, || get(&ip, 8080))
        .await
        .unwrap();
    assert!(page.contains(&token), "{page}");
    pods.delete("web", &Default::default()).await.unwrap();

    // A drain evicts through the PodDisruptionBudget: refused while it allows no
    // disruption, done once it does, the pod rescheduled on another node.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "app"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "app"}},
            "template": {
                "metadata": {"labels": {"app": "app"}},
                "spec": {
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": false,
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "app"}},
                    }],
                    "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                    "command": ["sh", "-c", "mkdir -p /www && echo app > /www/index.html && exec httpd -f -p 8080 -h /www"]}],
                },
            },
        },
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "app"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "app"}}},
    }))
    .unwrap();
    budgets
        .create(&PostParams::default(), &budget)
        .await
        .unwrap();
    let placed = |pods: Api<Pod>| async move {
        eventually("both replicas Running on two nodes", WAIT, || {
            let pods = pods.clone();
            async move {
                let list = pods
                    .list(&ListParams::default().labels("app=app"))
                    .await
                    .map_err(|e| e.to_string())?;
                let running: Vec<String> = list
                    .items
                    .iter()
                    .filter(|p| {
                        p.metadata.deletion_timestamp.is_none()
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
                    .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
                    .collect();
                let mut nodes = running.clone();
                nodes.sort();
                nodes.dedup();
                if running.len() == 2 && nodes.len() == 2 {
                    Ok(nodes)
                } else {
                    Err(format!("running on {running:?}"))
                }
            }
        })
        .await
        .unwrap()
    };
    let nodes = placed(pods.clone()).await;
    // The budget counts both replicas healthy before it allows anything.
    eventually("the budget observed", WAIT, || {
        let budgets = budgets.clone();
        async move {
            let b = budgets.get("app").await.map_err(|e| e.to_string())?;
            let healthy = b.status.and_then(|s| s.current_healthy).unwrap_or(0);
            if healthy == 2 {
                Ok(())
            } else {
                Err(format!("{healthy} healthy"))
            }
        }
    })
    .await
    .unwrap();
    let drained = nodes[0].clone();
    let refused = steward_testenv::node::drain(cp, &drained, Duration::from_secs(5))
        .await
        .expect_err("a drain the budget allows no disruption for");
    assert!(
        refused.to_string().contains("disruption budget"),
        "refused by the budget: {refused}"
    );
    budgets
        .patch(
            "app",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"minAvailable": 1}})),
        )
        .await
        .unwrap();
    steward_testenv::node::drain(cp, &drained, WAIT)
        .await
        .unwrap();
    let now = placed(pods.clone()).await;
    assert!(
        !now.contains(&drained),
        "no replica left on the drained node {drained}: {now:?}"
    );
    let cordoned = Api::<Node>::all(client.clone())
        .get(&drained)
        .await
        .unwrap();
    assert_eq!(
        cordoned.spec.and_then(|s| s.unschedulable),
        Some(true),
        "the drained node is cordoned"
    );
}

/// The tenant-operator's leases here: short, so a lost node costs seconds (the defaults are
/// 15 s / 10 s / 2 s).
const LEASE: Duration = Duration::from_secs(6);
const RENEW_DEADLINE: Duration = Duration::from_secs(4);
const RETRY: Duration = Duration::from_secs(1);

/// The sharded tenant-operator (`deploy/sharded/tenant-operator`: 3 replicas, `--shards=3`) as
/// its image on the three nodes: the Deployment's anti-affinity puts one replica on each, and
/// each holds one shard. The leader's node loses power: a replica on another node leads within
/// LeaseDuration + RetryPeriod, the lost replica's shard is taken by a live one within that
/// too, the shards of the replicas on the other nodes never move, and Tenants created then are
/// reconciled.
async fn the_sharded_tenant_operator_spreads_over_the_nodes_and_a_lost_node_moves_only_its_shards(
    cp: &mut ControlPlane,
    client: &Client,
) {
    use k8s_openapi::api::coordination::v1::Lease;
    use steward_testenv::deploy;

    // The drain before left a node cordoned.
    for node in cp.real_nodes() {
        node.uncordon(client).await.unwrap();
    }
    let entry = steward_operators::find("tenant-operator").unwrap();
    let built = deploy::build(&[deploy::Spec::of(&entry)])
        .expect("the tenant-operator's binary")
        .remove(0);
    cp.install_crds(&steward_testenv::workspace_root().join("crds"))
        .await
        .expect("CRDs");
    let args = [
        format!("--leader-election-lease-duration={}s", LEASE.as_secs()),
        format!(
            "--leader-election-renew-deadline={}s",
            RENEW_DEADLINE.as_secs()
        ),
        format!("--leader-election-retry-period={}s", RETRY.as_secs()),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let deployed = deploy::operator_from(
        cp,
        &built,
        &steward_testenv::workspace_root().join("deploy/sharded/tenant-operator"),
        &args,
        "real-nodes-test",
    )
    .await
    .expect("deploy the sharded tenant-operator");
    let took = deployed
        .wait_available(cp, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ns = deployed.namespace.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let list = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=tenant-operator"))
        .await
        .unwrap();
    let node_of: std::collections::BTreeMap<String, String> = list
        .items
        .iter()
        .map(|p| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
            (p.name_any(), node.unwrap_or_default())
        })
        .collect();
    let nodes: std::collections::BTreeSet<&String> = node_of.values().collect();
    assert_eq!(nodes.len(), 3, "one replica per node: {node_of:?}");

    // Who holds what: the leader's Lease and each shard's, by pod (identities are
    // `<pod>_<random>`).
    let names = ["tenant-operator".to_string()]
        .into_iter()
        .chain((0..3).map(|i| format!("tenant-operator-shard-{i}")))
        .collect::<Vec<_>>();
    let holders = || {
        let (leases, names, node_of) = (leases.clone(), names.clone(), node_of.clone());
        async move {
            let mut held = Vec::new();
            for name in &names {
                let lease = leases.get(name).await.map_err(|e| format!("{name}: {e}"))?;
                let spec = lease.spec.unwrap_or_default();
                let identity = spec.holder_identity.unwrap_or_default();
                let renewed = spec.renew_time.map(|t| t.0);
                let live = renewed.is_some_and(|t| {
                    let age = k8s_openapi::jiff::Timestamp::now().duration_since(t);
                    age.as_secs_f64() < LEASE.as_secs_f64()
                });
                let pod = node_of
                    .keys()
                    .find(|p| identity.starts_with(&format!("{p}_")))
                    .filter(|_| live)
                    .cloned();
                held.push(pod);
            }
            Ok::<_, String>(held)
        }
    };
    let before = eventually(
        "the leader's Lease and one shard per replica held",
        WAIT,
        || async {
            let held = holders().await?;
            let shards: std::collections::BTreeSet<&String> = held[1..].iter().flatten().collect();
            if held.iter().all(Option::is_some) && shards.len() == 3 {
                Ok(held)
            } else {
                Err(format!("held: {held:?}"))
            }
        },
    )
    .await
    .unwrap();
    let leader = before[0].clone().unwrap();
    let lost_node = node_of[&leader].clone();
    let index = cp
        .real_nodes()
        .iter()
        .position(|n| n.name() == lost_node)
        .unwrap();
    eprintln!(
        "sharded tenant-operator: 3 replicas Ready {took:.1?} after the apply, on {nodes:?}; leader {leader} on {lost_node}"
    );

    let stopped = Instant::now();
    cp.real_node_mut(index).unwrap().stop().unwrap();
    // Until the leader's Lease and the lost replica's shard are held elsewhere, every shard
    // of a live replica stays with it.
    let bound = LEASE + RETRY + Duration::from_secs(3);
    let mut moved_early = Vec::new();
    let after = loop {
        let held = holders().await.unwrap_or_default();
        for (i, (was, is)) in before.iter().zip(&held).enumerate().skip(1) {
            if was.as_ref() != Some(&leader) && is.is_some() && is != was {
                moved_early.push(format!("{}: {was:?} -> {is:?}", names[i]));
            }
        }
        let taken = held.len() == 4
            && held
                .iter()
                .all(|h| h.as_ref().is_some_and(|p| node_of[p] != lost_node));
        if taken {
            break held;
        }
        assert!(
            stopped.elapsed() < bound * 3,
            "not taken over from {leader} within {:?}: {held:?}",
            bound * 3
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let taken_in = stopped.elapsed();
    eprintln!(
        "the leader's node {lost_node} lost power: the Lease and its shard held on other nodes {taken_in:.1?} later ({after:?}); LeaseDuration + RetryPeriod is {:?}",
        LEASE + RETRY
    );
    assert!(
        moved_early.is_empty(),
        "the shards of replicas on live nodes moved: {moved_early:?}"
    );
    assert!(
        taken_in <= bound,
        "taken over within LeaseDuration + RetryPeriod (+3 s for the checks' own latency on a loaded machine): {taken_in:?}"
    );

    // The live replicas reconcile every shard: Tenants made now get their namespaces.
    let tenants = Api::<tenant_operator::crd::Tenant>::all(client.clone());
    for i in 0..3 {
        let tenant: tenant_operator::crd::Tenant = serde_json::from_value(json!({
            "apiVersion": "tenancy.steward.dev/v1alpha1", "kind": "Tenant",
            "metadata": {"name": format!("nodes-{i}")},
            "spec": {"owners": [{"kind": "Group", "name": format!("team-{i}")}],
                     "namespaces": [format!("nodes-{i}-a")]},
        }))
        .unwrap();
        tenants
            .create(&PostParams::default(), &tenant)
            .await
            .unwrap();
    }
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    eventually("each Tenant's namespace, whatever its shard", WAIT, || {
        let namespaces = namespaces.clone();
        async move {
            let mut missing = Vec::new();
            for i in 0..3 {
                let name = format!("nodes-{i}-a");
                if namespaces
                    .get_opt(&name)
                    .await
                    .map_err(|e| e.to_string())?
                    .is_none()
                {
                    missing.push(name);
                }
            }
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing {missing:?}"))
            }
        }
    })
    .await
    .unwrap();
    cp.real_node_mut(index)
        .unwrap()
        .start_again(client, WAIT)
        .await
        .unwrap();
}
