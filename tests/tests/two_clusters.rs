//! Two Kubernetes clusters on one host (`ControlPlane::start_pair`), each a control plane
//! with a real node of its own, linked only by what a real deployment of two clusters shares:
//! the host, where an object store listens, and routed pod addresses. The layout for disaster
//! recovery across clusters (#42). Needs root.

#![allow(clippy::unwrap_used)] // tests fail loudly

use std::time::Instant;

use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use steward_testenv::node::teardown::leftovers;
use steward_testenv::s3::S3Server;
use steward_testenv::{ControlPlane, Options, eventually};

#[path = "support/real_node.rs"]
mod support;
use support::{WAIT, get, logs, rand_u32, service};

/// A pod of `image` on the cluster's node running `script` with `sh -c`, labelled
/// `app: <name>`.
fn pod(name: &str, image: &str, restart: &str, script: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", script]}],
        }
    }))
    .unwrap()
}

/// The pod's IP once it runs.
async fn running_ip(pods: &Api<Pod>, name: &str) -> String {
    eventually(&format!("pod {name} Running"), WAIT, || async move {
        let status = pods
            .get(name)
            .await
            .map_err(|e| e.to_string())?
            .status
            .unwrap_or_default();
        match (status.phase.as_deref(), status.pod_ip) {
            (Some("Running"), Some(ip)) => Ok(ip),
            (phase, ip) => Err(format!("phase {phase:?}, IP {ip:?}")),
        }
    })
    .await
    .unwrap()
}

/// The pod's phase once it has finished.
async fn finished(pods: &Api<Pod>, name: &str) -> String {
    eventually(&format!("pod {name} finished"), WAIT, || async move {
        let pod = pods.get(name).await.map_err(|e| e.to_string())?;
        match pod.status.and_then(|s| s.phase).as_deref() {
            Some(p @ ("Succeeded" | "Failed")) => Ok(p.to_string()),
            other => Err(format!("phase {other:?}")),
        }
    })
    .await
    .unwrap()
}

/// Creates namespace `name` and waits for its `default` ServiceAccount.
async fn same_namespace(cp: &ControlPlane, name: &str) {
    let client = cp.client().unwrap();
    let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    let accounts: Api<ServiceAccount> = Api::namespaced(client, name);
    eventually(&format!("ServiceAccount {name}/default"), WAIT, || async {
        match accounts.get_opt("default").await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err("not yet".to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .unwrap();
}

/// One cluster of the pair as the test uses it.
struct Side<'a> {
    cp: &'a ControlPlane,
    pods: Api<Pod>,
    token: String,
    cluster_ip: String,
    web_ip: String,
}

/// Two control planes with a real node each: each sees only its own node; in each, a pod
/// resolves the Service of the same name and namespace as the other's to its own cluster's
/// address and reaches it; both reach the object store on the host and each other's pod IPs;
/// the test process reaches both clusters' Services; then the host is clean.
#[tokio::test]
async fn two_clusters_on_one_host_share_only_the_object_store_and_routed_pod_addresses() {
    let started = Instant::now();
    let (a, b) = ControlPlane::start_pair(Options::real_nodes(1), Options::real_nodes(1))
        .await
        .expect("two control planes with a real node each");
    let (node_a, node_b) = (a.real_node().unwrap(), b.real_node().unwrap());
    eprintln!(
        "two control planes with a Ready real node each in {:.1?} ({} {:.1?}, {} {:.1?})",
        started.elapsed(),
        node_a.name(),
        node_a.started_in(),
        node_b.name(),
        node_b.started_in(),
    );
    assert_ne!(node_a.host_address(), node_b.host_address());

    // Each cluster sees its own node only.
    for (cp, own) in [(&a, node_a.name()), (&b, node_b.name())] {
        let names: Vec<String> = Api::<Node>::all(cp.client().unwrap())
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        assert_eq!(names, [own], "{}", cp.apiserver_url());
    }

    // The object store both clusters share, on the first's host address (the second's pods
    // reach every host address on the link too).
    let s3 = S3Server::start(node_a.host_address(), &["b"])
        .await
        .expect("S3 server");
    let s3_addr = s3.endpoint().trim_start_matches("http://").to_string();
    let (s3_ip, s3_port) = s3_addr.split_once(':').unwrap();

    // The same namespace and Service name in both: each pod resolves its own cluster's.
    let ns = a.namespace("two").await.unwrap();
    same_namespace(&b, &ns).await;
    let mut sides = Vec::new();
    let started = Instant::now();
    for cp in [&a, &b] {
        let client = cp.client().unwrap();
        let image = cp.real_node().unwrap().busybox_image().await.unwrap();
        let pods: Api<Pod> = Api::namespaced(client, &ns);
        let token = format!("token-{:08x}", rand_u32());
        let script = format!(
            "mkdir -p /www && echo {token} > /www/index.html && exec httpd -f -p 8080 -h /www"
        );
        pods.create(
            &PostParams::default(),
            &pod("web", &image, "Always", &script),
        )
        .await
        .unwrap();
        let cluster_ip = service(cp, &ns, "web", 80, 8080).await;
        sides.push((cp, pods, token, cluster_ip, image));
    }
    let mut ready = Vec::new();
    for (cp, pods, token, cluster_ip, image) in sides {
        let web_ip = running_ip(&pods, "web").await;
        ready.push((
            Side {
                cp,
                pods,
                token,
                cluster_ip,
                web_ip,
            },
            image,
        ));
    }
    eprintln!("a web pod Running in each in {:.1?}", started.elapsed());
    let (first, second) = (&ready[0].0, &ready[1].0);
    // Each cluster's Services in its half of the Service range, its pods in its node's network.
    let third = |ip: &str| ip.split('.').nth(2).unwrap().parse::<u8>().unwrap();
    assert!(first.cluster_ip.starts_with("198.19.") && third(&first.cluster_ip) < 128);
    assert!(second.cluster_ip.starts_with("198.19.") && third(&second.cluster_ip) >= 128);
    assert!(first.web_ip.starts_with("198.18.1."), "{}", first.web_ip);
    assert!(second.web_ip.starts_with("198.18.2."), "{}", second.web_ip);

    // The test process reaches both clusters' Services (each through its host-side kube-proxy).
    let started = Instant::now();
    for side in [first, second] {
        let page = eventually(
            &format!("GET {}:80 from the host", side.cluster_ip),
            WAIT,
            || get(&side.cluster_ip, 80),
        )
        .await
        .unwrap();
        assert!(page.contains(&side.token), "{page}");
    }
    eprintln!(
        "the host reached both clusters' Services in {:.1?}",
        started.elapsed()
    );

    // In each cluster a pod resolves the Service, reaches it, the object store and the other
    // cluster's web pod by its IP.
    let started = Instant::now();
    let name = format!("web.{ns}.svc.cluster.local");
    for (i, (side, image)) in ready.iter().enumerate() {
        let other = &ready[1 - i].0;
        let script = format!(
            "ip=$(nslookup {name} | awk '/^Address: /{{print $2}}' | tail -1); echo resolved $ip; \
             for i in $(seq 1 30); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 $ip 80 | grep -q {token} && echo through the Service && break; sleep 0.3; done; \
             for i in $(seq 1 30); do s=$(printf 'GET /b HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {s3_ip} {s3_port} | head -1); [ -n \"$s\" ] && echo object store answered $s && break; sleep 0.3; done; \
             for i in $(seq 1 30); do printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {other_ip} 8080 | grep -q {other_token} && echo reached {other_token} && break; sleep 0.3; done",
            token = side.token,
            other_ip = other.web_ip,
            other_token = other.token,
        );
        side.pods
            .create(
                &PostParams::default(),
                &pod("client", image, "Never", &script),
            )
            .await
            .unwrap();
    }
    for (side, _) in &ready {
        let phase = finished(&side.pods, "client").await;
        let text = logs(&side.pods, "client").await;
        let other = if std::ptr::eq(side, first) {
            second
        } else {
            first
        };
        let url = side.cp.apiserver_url();
        assert_eq!(phase, "Succeeded", "{url}: client log:\n{text}");
        assert!(
            text.contains(&format!("resolved {}\n", side.cluster_ip)),
            "{url}: {text}"
        );
        assert!(text.contains("through the Service"), "{url}: {text}");
        assert!(
            text.contains("object store answered HTTP/1.1"),
            "{url}: {text}"
        );
        assert!(
            text.contains(&format!("reached {}", other.token)),
            "{url}: {text}"
        );
        eprintln!(
            "{}: {}",
            side.cp.real_node().unwrap().name(),
            text.trim().replace('\n', "; ")
        );
    }
    eprintln!(
        "both clients resolved, reached their Service, the object store and the other cluster's pod in {:.1?}",
        started.elapsed()
    );

    drop(s3);
    let during = leftovers();
    for kind in [
        "netns /run/netns/steward-node-0",
        "netns /run/netns/steward-node-1",
        "netns /run/netns/steward-node-svc-1",
        "bridge steward-link",
    ] {
        assert!(
            during.iter().any(|l| l.contains(kind)),
            "running clusters have a {kind} (else the check below proves nothing): {during:#?}"
        );
    }
    drop(ready);
    let dropped = Instant::now();
    drop(a);
    drop(b);
    eprintln!(
        "both clusters dropped and the host swept in {:.1?}",
        dropped.elapsed()
    );
    let left = leftovers();
    assert!(left.is_empty(), "left on the host: {left:#?}");
}
