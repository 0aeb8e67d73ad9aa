//! The real node's configuration files, as pure functions of a [`Layout`] (unit-tested).

use std::path::PathBuf;

use super::{
    BRIDGE, CLUSTER_DOMAIN, GATEWAY, NODE_NAME, NODE_ROOT, NODE_RUN, POD_CIDR, SERVICE_CIDR,
};

/// The host's address on the link every node of a several-node cluster has to the host (the
/// API server, CoreDNS and the object store listen there for them). In a pair, the first
/// control plane's; the second's is [`PAIR_HOSTS`]`[1]`, on the same link.
pub const LINK_HOST: &str = "198.18.100.1";
/// How many control planes share the host in a pair ([`Cluster::pair`]).
pub const PAIR: usize = 2;
/// A pair's Service CIDRs: the halves of [`SERVICE_CIDR`], so the host routes each to the
/// kube-proxy that knows its Services.
pub const PAIR_SERVICE_CIDRS: [&str; PAIR] = ["198.19.0.0/17", "198.19.128.0/17"];
/// A pair's host addresses on the link (each control plane's API server and CoreDNS, as its
/// nodes reach them).
pub const PAIR_HOSTS: [&str; PAIR] = [LINK_HOST, "198.18.100.101"];
/// Where a pair's second control plane's host-side kube-proxy sits on the link (a network
/// namespace of its own: two kube-proxies cannot share one).
const PAIR_SERVICES: &str = "198.18.100.201";
/// The bridge on the host the nodes' links are attached to.
pub const LINK_BRIDGE: &str = "steward-link";
/// The prefix length of the link network (`198.18.100.0/24`).
pub const LINK_PREFIX: u8 = 24;
/// Every pod network of a several-node cluster (node `i`'s is `198.18.<i+1>.0/24`).
const PODS_CIDR: &str = "198.18.0.0/17";
/// The most nodes one host runs (their pod networks and link addresses are numbered).
pub const MAX_NODES: usize = 16;

/// Where one real node sits: its name, network namespace and addresses, its directories and
/// cgroup. The single node of [`Site::single`] is the host's own; each node of
/// [`Site::of_several`] has a network namespace of its own, linked to the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Site {
    pub name: String,
    /// The network namespace (`/run/netns/<netns>`) its components run in; `None`: the host's.
    pub netns: Option<String>,
    /// Its InternalIP: kubelet and NodePorts listen there.
    pub node_ip: String,
    /// The pods' gateway: the address of its bridge [`BRIDGE`].
    pub gateway: String,
    /// Its pods' addresses.
    pub pod_cidr: String,
    /// What its pods reach through the gateway (nothing outside 198.18.0.0/15).
    pub pod_routes: Vec<String>,
    /// Every pod address of the cluster (kube-proxy's `clusterCIDR`).
    pub cluster_cidr: String,
    /// The host's address as the node reaches it: the API server, CoreDNS.
    pub host: String,
    /// Runtime state, sockets and configuration.
    pub run: PathBuf,
    /// Persistent state (kubelet, containerd, volumes).
    pub root: PathBuf,
    /// kubelet's `cgroupRoot` (`None`: the hierarchies' roots).
    pub cgroup_root: Option<String>,
    /// Its `topology.kubernetes.io/zone`.
    pub zone: Option<String>,
}

impl Site {
    /// The one real node of a machine, in the host's network namespace (as before several
    /// nodes existed): [`NODE_NAME`] on bridge [`BRIDGE`] at [`GATEWAY`].
    pub(crate) fn single() -> Self {
        Self {
            name: NODE_NAME.into(),
            netns: None,
            node_ip: GATEWAY.into(),
            gateway: GATEWAY.into(),
            pod_cidr: POD_CIDR.into(),
            pod_routes: vec![SERVICE_CIDR.into()],
            cluster_cidr: POD_CIDR.into(),
            host: GATEWAY.into(),
            run: NODE_RUN.into(),
            root: NODE_ROOT.into(),
            cgroup_root: None,
            zone: None,
        }
    }

    /// Node `index` (from 0) of several: `steward-node-<index>` in network namespace
    /// `steward-node-<index>`, at `198.18.100.<index+2>` on the host's link bridge, its pods
    /// in `198.18.<index+1>.0/24`, in zone `zone-<index>`.
    pub(crate) fn of_several(index: usize) -> Self {
        Self::numbered(index, index, LINK_HOST)
    }

    /// Node `index` of the host (its name, addresses, directories and cgroup follow it), node
    /// `local` of its control plane (its zone), whose host address is `host`.
    fn numbered(index: usize, local: usize, host: &str) -> Self {
        let name = format!("{NODE_NAME}-{index}");
        Self {
            netns: Some(name.clone()),
            node_ip: format!("198.18.100.{}", index + 2),
            gateway: format!("198.18.{}.1", index + 1),
            pod_cidr: format!("198.18.{}.0/24", index + 1),
            // Pods of other nodes, Services, the host's link: all in the benchmarking range.
            pod_routes: vec!["198.18.0.0/15".into()],
            cluster_cidr: PODS_CIDR.into(),
            host: host.into(),
            run: PathBuf::from(NODE_RUN).join(&name),
            root: PathBuf::from(NODE_ROOT).join(&name),
            cgroup_root: Some(format!("/{name}")),
            zone: Some(format!("zone-{local}")),
            name,
        }
    }

    pub(crate) fn containerd_socket(&self) -> PathBuf {
        self.run.join("containerd.sock")
    }
    pub(crate) fn containerd_config(&self) -> PathBuf {
        self.run.join("containerd.toml")
    }
    pub(crate) fn cni_conf_dir(&self) -> PathBuf {
        self.run.join("cni")
    }
    pub(crate) fn kubelet_config(&self) -> PathBuf {
        self.run.join("kubelet.yaml")
    }
    pub(crate) fn kubelet_root(&self) -> PathBuf {
        self.root.join("kubelet")
    }
    pub(crate) fn proxy_config(&self) -> PathBuf {
        self.run.join("kube-proxy.yaml")
    }
    pub(crate) fn resolv_conf(&self) -> PathBuf {
        self.run.join("resolv.conf")
    }
    /// The kubeconfig of its components (the API server's address as the node reaches it).
    pub(crate) fn kubeconfig(&self) -> PathBuf {
        self.run.join("kubeconfig")
    }
}

/// One control plane's share of the host: its nodes' sites, its Services' addresses, the
/// host's address its nodes reach (API server, CoreDNS) and where the host-side kube-proxy
/// runs, through which the test process reaches its Services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Cluster {
    /// Its place on the host: 0 alone or first of a pair, 1 second of a pair.
    pub index: usize,
    pub sites: Vec<Site>,
    /// The API server's `--service-cluster-ip-range`.
    pub service_cidr: String,
    /// The host's address as its nodes reach it: the API server, CoreDNS (kubelet's
    /// `clusterDNS`), the `kubernetes` Service's endpoint.
    pub host: String,
    /// CoreDNS's Corefile and what else of the host's side is the control plane's own.
    pub run: PathBuf,
    /// Where the host's kube-proxy for its Services runs (named after its first node, which
    /// kube-proxy waits for): in the host's network namespace for the first control plane,
    /// in one of its own (`steward-node-svc-<index>`, on the link) for the second. `None`
    /// for the single node, whose own kube-proxy is the host's.
    pub services: Option<Site>,
}

impl Cluster {
    /// A control plane alone on the host with `count` real nodes: one in the host's network
    /// namespace ([`Site::single`]) or several ([`Site::of_several`]).
    ///
    /// # Errors
    /// A message for a count outside 1 to [`MAX_NODES`].
    pub(crate) fn alone(count: usize) -> Result<Self, String> {
        if !(1..=MAX_NODES).contains(&count) {
            return Err(format!("{count} real nodes: a host runs 1 to {MAX_NODES}"));
        }
        if count == 1 {
            return Ok(Self {
                index: 0,
                sites: vec![Site::single()],
                service_cidr: SERVICE_CIDR.into(),
                host: GATEWAY.into(),
                run: NODE_RUN.into(),
                services: None,
            });
        }
        let sites: Vec<Site> = (0..count).map(Site::of_several).collect();
        Ok(Self {
            index: 0,
            services: Some(Self::host_services(&sites[0])),
            sites,
            service_cidr: SERVICE_CIDR.into(),
            host: LINK_HOST.into(),
            run: NODE_RUN.into(),
        })
    }

    /// Two control planes on one host with `counts` real nodes each, every node in a network
    /// namespace of its own on the one link bridge (one node too): the first's nodes are the
    /// host's nodes `0..counts[0]`, the second's the next ones (names, addresses, pod
    /// networks, directories and cgroups follow the host's numbering, zones the control
    /// plane's). Each has its own Service CIDR ([`PAIR_SERVICE_CIDRS`]) and host address
    /// ([`PAIR_HOSTS`]).
    ///
    /// # Errors
    /// A message when either has no node or both together more than [`MAX_NODES`].
    pub(crate) fn pair(counts: [usize; PAIR]) -> Result<[Self; PAIR], String> {
        if counts.contains(&0) || counts.iter().sum::<usize>() > MAX_NODES {
            return Err(format!(
                "real nodes {counts:?}: each control plane of a pair needs at least one, both together at most {MAX_NODES}"
            ));
        }
        let cluster = |index: usize| {
            let first = counts[..index].iter().sum::<usize>();
            let host = PAIR_HOSTS[index];
            let sites: Vec<Site> = (0..counts[index])
                .map(|local| Site::numbered(first + local, local, host))
                .collect();
            let run = if index == 0 {
                PathBuf::from(NODE_RUN)
            } else {
                PathBuf::from(NODE_RUN).join(format!("cluster-{index}"))
            };
            let services = if index == 0 {
                Self::host_services(&sites[0])
            } else {
                let netns = format!("{NODE_NAME}-svc-{index}");
                Site {
                    netns: Some(netns),
                    node_ip: PAIR_SERVICES.into(),
                    run: run.join("services"),
                    root: run.join("services"),
                    cgroup_root: None,
                    zone: None,
                    ..sites[0].clone()
                }
            };
            Self {
                index,
                sites,
                service_cidr: PAIR_SERVICE_CIDRS[index].into(),
                host: host.into(),
                run,
                services: Some(services),
            }
        };
        Ok([cluster(0), cluster(1)])
    }

    /// The host's own kube-proxy, in its network namespace at [`LINK_HOST`].
    fn host_services(first: &Site) -> Site {
        Site {
            netns: None,
            node_ip: LINK_HOST.into(),
            run: PathBuf::from(NODE_RUN).join("host"),
            ..first.clone()
        }
    }

    /// Whether its nodes run in network namespaces of their own (several, or one of a pair).
    pub(crate) fn in_namespaces(&self) -> bool {
        self.sites.iter().all(|s| s.netns.is_some())
    }

    /// The Corefile of its CoreDNS.
    pub(crate) fn corefile(&self) -> PathBuf {
        self.run.join("Corefile")
    }
}

/// Where the node's files and endpoints are.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub site: Site,
    /// The control plane's admin kubeconfig (kubelet, kube-proxy and CoreDNS use it).
    pub kubeconfig: PathBuf,
    /// Directory of containerd-shim-runc-v2 (containerd is told its path).
    pub shim: PathBuf,
    /// `runc` from Debian's package.
    pub runc: PathBuf,
    /// CNI plugin directory from Debian's `containernetworking-plugins`.
    pub cni_bin: PathBuf,
    /// Ports for health and metrics endpoints (on loopback for the host's node, on the node's
    /// address for a node in a namespace of its own, so the host can reach them).
    pub kubelet_healthz_port: u16,
    pub proxy_healthz_port: u16,
    pub proxy_metrics_port: u16,
    /// kube-proxy's `masqueradeAll`: a host-side kube-proxy in a network namespace of its own
    /// (a pair's second) is a hop on the way, so the replies must come back through it.
    pub masquerade_all: bool,
}

impl Layout {
    /// The address the node's health endpoints listen on.
    pub(crate) fn health_ip(&self) -> &str {
        if self.site.netns.is_some() {
            &self.site.node_ip
        } else {
            "127.0.0.1"
        }
    }
}

/// The host's CoreDNS of one control plane: where it listens and its health ports.
#[derive(Clone, Debug)]
pub(crate) struct Dns {
    pub kubeconfig: PathBuf,
    /// The address it serves on, its control plane's host address ([`Cluster::host`]:
    /// [`GATEWAY`] with one node, [`LINK_HOST`] with several, [`PAIR_HOSTS`] in a pair).
    pub address: String,
    pub health_port: u16,
    pub ready_port: u16,
}

/// containerd 2 (config version 3): state under the node's own directories, the sandbox image
/// pinned to the locally built pause image, runc from Debian, CNI from Debian.
pub(crate) fn containerd(layout: &Layout, pause_reference: &str) -> String {
    let site = &layout.site;
    format!(
        r#"version = 3
root = "{root}/containerd"
state = "{run}/containerd"
imports = []
# The opt plugin would create /opt/containerd; NRI would listen on /var/run/nri.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{pause_reference}"

[plugins."io.containerd.cri.v1.runtime"]
  # This machine's root lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  disable_apparmor = true
  cdi_spec_dirs = []
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{run}/runc"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
    max_conf_num = 1

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"#,
        root = site.root.display(),
        run = site.run.display(),
        socket = site.containerd_socket().display(),
        shim = layout.shim.display(),
        runc = layout.runc.display(),
        cni_bin = layout.cni_bin.display(),
        cni_conf = site.cni_conf_dir().display(),
    )
}

/// The pod network: Debian's `bridge` plugin on the node's bridge [`BRIDGE`] (gateway = the
/// node's bridge address), `host-local` addresses in its pod network, routes through the
/// gateway only to the site's `pod_routes` (all in 198.18.0.0/15) and no masquerade (nothing
/// leaves the machine), plus `portmap` for hostPorts. The network is named after the node, so
/// the CNI library's caches under `/var/lib/cni` never mix nodes.
pub(crate) fn cni_conflist(site: &Site) -> String {
    let routes: Vec<serde_json::Value> = site
        .pod_routes
        .iter()
        .map(|dst| serde_json::json!({"dst": dst}))
        .collect();
    let name = if site.netns.is_some() {
        site.name.clone()
    } else {
        "steward".to_string()
    };
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": format!("{}/cni-ipam", site.root.display()),
                    "ranges": [[{"subnet": site.pod_cidr, "gateway": site.gateway}]],
                    "routes": routes
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string()
}

/// KubeletConfiguration for a cgroup v1 host without swap accounting, with anonymous access
/// (the API server reaches it on the node's address) and no image garbage collection (images
/// cannot be pulled again). A node of several has a cgroup root of its own, so no kubelet
/// takes another's pods for orphans.
pub(crate) fn kubelet(layout: &Layout) -> String {
    let site = &layout.site;
    let mut several = String::new();
    if let Some(root) = &site.cgroup_root {
        several.push_str(&format!("cgroupRoot: {root}\n"));
    }
    if site.netns.is_some() {
        // Renewed every 5 s (a quarter), well within the controller manager's grace period
        // (`crate::controlplane::NODE_MONITOR_GRACE`).
        several.push_str("nodeLeaseDurationSeconds: 20\n");
    }
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {node_ip}
port: 10250
readOnlyPort: 0
healthzBindAddress: {health_ip}
healthzPort: {healthz}
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
{several}failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{socket}
clusterDNS: [{dns}]
clusterDomain: {CLUSTER_DOMAIN}
resolvConf: {resolv}
podLogsDir: {root}/pod-logs
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  imagefs.available: "1%"
  nodefs.inodesFree: "1%"
serializeImagePulls: false
hairpinMode: hairpin-veth
syncFrequency: 10s
nodeStatusUpdateFrequency: 4s
"#,
        node_ip = site.node_ip,
        health_ip = layout.health_ip(),
        healthz = layout.kubelet_healthz_port,
        socket = site.containerd_socket().display(),
        dns = site.host,
        resolv = site.resolv_conf().display(),
        root = site.root.display(),
    )
}

/// KubeProxyConfiguration: iptables mode, NodePorts only on the node's address, and no
/// host-wide conntrack or `route_localnet` sysctl changes.
pub(crate) fn kube_proxy(layout: &Layout) -> String {
    let site = &layout.site;
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {name}
bindAddress: {node_ip}
healthzBindAddress: {health_ip}:{healthz}
metricsBindAddress: {health_ip}:{metrics}
mode: iptables
clusterCIDR: {cluster_cidr}
nodePortAddresses: ["{node_ip}/32"]
oomScoreAdj: 0
iptables:
  masqueradeAll: {masquerade_all}
  localhostNodePorts: false
  minSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = layout.kubeconfig.display(),
        name = site.name,
        node_ip = site.node_ip,
        health_ip = layout.health_ip(),
        healthz = layout.proxy_healthz_port,
        metrics = layout.proxy_metrics_port,
        cluster_cidr = site.cluster_cidr,
        masquerade_all = layout.masquerade_all,
    )
}

/// The host's CoreDNS, for every node: the cluster domain and reverse zones from the API,
/// nothing forwarded (no name outside the cluster resolves; nothing leaves the machine).
pub(crate) fn corefile(dns: &Dns) -> String {
    format!(
        r#".:53 {{
    bind {address}
    errors
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        ttl 5
    }}
}}
"#,
        address = dns.address,
        health = dns.health_port,
        ready = dns.ready_port,
        kubeconfig = dns.kubeconfig.display(),
    )
}

/// The kubeconfig of a node's components, from the control plane's `admin` one: the API
/// server at `host` instead of loopback (which is the node's own in a namespace of its own),
/// its certificate checked for the name `kubernetes` (the API server's self-signed certificate
/// names loopback and the Service, not the host's link address).
pub(crate) fn node_kubeconfig(admin: &str, host: &str) -> String {
    let mut out = String::new();
    for line in admin.lines() {
        if let Some(url) = line.trim_start().strip_prefix("server: https://127.0.0.1:") {
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}server: https://{host}:{url}\n"));
            out.push_str(&format!("{indent}tls-server-name: kubernetes\n"));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(site: Site) -> Layout {
        Layout {
            site,
            kubeconfig: "/tmp/kc".into(),
            shim: "/cache/containerd-shim-runc-v2".into(),
            runc: "/usr/sbin/runc".into(),
            cni_bin: "/usr/lib/cni".into(),
            kubelet_healthz_port: 1,
            proxy_healthz_port: 2,
            proxy_metrics_port: 3,
            masquerade_all: false,
        }
    }

    fn dns() -> Dns {
        Dns {
            kubeconfig: "/tmp/kc".into(),
            address: LINK_HOST.into(),
            health_port: 4,
            ready_port: 5,
        }
    }

    fn sites() -> Vec<Site> {
        let mut sites = vec![Site::single()];
        sites.extend((0..MAX_NODES).map(Site::of_several));
        for cluster in Cluster::pair([3, 2]).unwrap() {
            sites.extend(cluster.sites.iter().cloned().chain(cluster.services));
        }
        sites
    }

    /// `a.b.c.d/p` (or an address, as `/32`) as its first address and mask.
    fn cidr(text: &str) -> (u32, u32) {
        let (addr, prefix) = text.split_once('/').unwrap_or((text, "32"));
        let addr: std::net::Ipv4Addr = addr.parse().unwrap();
        let prefix: u32 = prefix.parse().unwrap();
        let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
        (u32::from(addr) & mask, mask)
    }

    fn overlap(a: &str, b: &str) -> bool {
        let ((a, am), (b, bm)) = (cidr(a), cidr(b));
        let mask = am & bm;
        a & mask == b & mask
    }

    /// A cluster's own addresses and networks: host, Services, its nodes' and host-side
    /// kube-proxy's addresses, its pod networks.
    fn networks(cluster: &Cluster) -> Vec<String> {
        let mut all = vec![cluster.host.clone(), cluster.service_cidr.clone()];
        for site in &cluster.sites {
            all.extend([site.node_ip.clone(), site.pod_cidr.clone()]);
        }
        all.extend(cluster.services.iter().map(|s| s.node_ip.clone()));
        all
    }

    #[test]
    fn addresses_stay_in_the_benchmarking_range() {
        for site in sites() {
            for text in [
                containerd(&layout(site.clone()), "p:1"),
                cni_conflist(&site),
                kubelet(&layout(site.clone())),
                kube_proxy(&layout(site.clone())),
                corefile(&dns()),
            ] {
                for word in text.split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '/')) {
                    let addr = word.split('/').next().unwrap_or_default();
                    let octets: Vec<u8> = addr.split('.').filter_map(|o| o.parse().ok()).collect();
                    if octets.len() == 4 && addr.split('.').count() == 4 {
                        let ok = octets[0] == 127 || (octets[0] == 198 && (octets[1] & 0xfe) == 18);
                        assert!(ok, "address {word} outside 127/8 and 198.18/15 in:\n{text}");
                    }
                }
            }
        }
    }

    #[test]
    fn several_nodes_never_share_an_address_a_directory_or_a_cgroup() {
        let several: Vec<Site> = (0..MAX_NODES).map(Site::of_several).collect();
        for (i, a) in several.iter().enumerate() {
            for b in &several[i + 1..] {
                assert_ne!(a.name, b.name);
                assert_ne!(a.netns, b.netns);
                assert_ne!(a.node_ip, b.node_ip);
                assert_ne!(a.pod_cidr, b.pod_cidr);
                assert_ne!(a.run, b.run);
                assert_ne!(a.root, b.root);
                assert_ne!(a.cgroup_root, b.cgroup_root);
            }
            // No pod network overlaps the link network, the Services or kwok's fake pods
            // (198.18.128.0/17).
            let third: u8 = a.pod_cidr.split('.').nth(2).unwrap().parse().unwrap();
            assert!((1..100).contains(&third), "{}", a.pod_cidr);
            assert!(a.run.starts_with(NODE_RUN) && a.root.starts_with(NODE_ROOT));
            assert_ne!(cni_conflist(a), cni_conflist(&several[(i + 1) % MAX_NODES]));
        }
    }

    #[test]
    fn a_pair_of_control_planes_shares_no_address_network_name_path_or_cgroup() {
        for counts in [[1, 1], [3, 2], [1, MAX_NODES - 1]] {
            let [a, b] = Cluster::pair(counts).unwrap();
            assert_eq!((a.sites.len(), b.sites.len()), (counts[0], counts[1]));
            assert!(a.in_namespaces() && b.in_namespaces());
            for x in networks(&a) {
                for y in networks(&b) {
                    assert!(
                        !overlap(&x, &y),
                        "{counts:?}: {x} (first) overlaps {y} (second)"
                    );
                }
            }
            let (sa, sb) = (a.services.clone().unwrap(), b.services.clone().unwrap());
            for x in a.sites.iter().chain([&sa]) {
                for y in b.sites.iter().chain([&sb]) {
                    assert_ne!(x.name, y.name);
                    assert_ne!(x.node_ip, y.node_ip);
                    assert_ne!(x.run, y.run);
                    assert_ne!(x.root, y.root);
                    assert!(x.netns.is_none() || x.netns != y.netns);
                    assert!(x.cgroup_root.is_none() || x.cgroup_root != y.cgroup_root);
                    assert_ne!(x.host, y.host);
                }
            }
            assert_ne!(a.corefile(), b.corefile());
            assert!(b.run.starts_with(NODE_RUN) && b.run != a.run);
            // Within each: its host address and host-side kube-proxy are no node's address.
            for cluster in [&a, &b] {
                let services = cluster.services.as_ref().unwrap();
                for site in &cluster.sites {
                    assert_ne!(site.node_ip, cluster.host);
                    assert_ne!(site.node_ip, services.node_ip);
                    assert!(overlap(
                        &format!("{}/{LINK_PREFIX}", LINK_HOST),
                        &site.node_ip
                    ));
                    assert!(!overlap(&site.pod_cidr, "198.18.100.0/24"));
                    assert!(!overlap(&site.pod_cidr, "198.18.128.0/17"), "kwok's pods");
                    assert_eq!(site.host, cluster.host);
                }
            }
            // The first is laid out as several nodes alone (its zones too), in half the
            // Services; the second's zones count from its own first node.
            let alone = (0..counts[0]).map(Site::of_several).collect::<Vec<_>>();
            assert_eq!(a.sites, alone);
            assert_eq!(b.sites[0].zone.as_deref(), Some("zone-0"));
            assert!(
                overlap(SERVICE_CIDR, &a.service_cidr) && overlap(SERVICE_CIDR, &b.service_cidr)
            );
        }
        assert!(Cluster::pair([0, 1]).is_err());
        assert!(Cluster::pair([MAX_NODES, 1]).is_err());
        assert!(Cluster::alone(0).is_err() && Cluster::alone(MAX_NODES + 1).is_err());
    }

    #[test]
    fn the_second_of_a_pair_has_its_own_dns_services_and_host_side_kube_proxy() {
        let [a, b] = Cluster::pair([2, 1]).unwrap();
        let node = &b.sites[0];
        assert_eq!(node.name, "steward-node-2");
        let kubelet = kubelet(&layout(node.clone()));
        assert!(
            kubelet.contains("clusterDNS: [198.18.100.101]"),
            "{kubelet}"
        );
        assert!(
            node_kubeconfig("    server: https://127.0.0.1:1\n", &b.host)
                .contains("https://198.18.100.101:1")
        );
        let services = b.services.clone().unwrap();
        assert_eq!(services.netns.as_deref(), Some("steward-node-svc-1"));
        assert_eq!(
            services.name, node.name,
            "it waits for the second's first node"
        );
        let proxy = kube_proxy(&Layout {
            masquerade_all: true,
            ..layout(services)
        });
        assert!(
            proxy.contains("iptables:\n  masqueradeAll: true\n"),
            "{proxy}"
        );
        assert!(proxy.contains("bindAddress: 198.18.100.201\n"));
        assert_eq!(
            a.services.unwrap().netns,
            None,
            "the first's runs in the host's namespace"
        );
        assert_eq!(
            (a.service_cidr.as_str(), b.service_cidr.as_str()),
            ("198.19.0.0/17", "198.19.128.0/17")
        );
        assert_eq!(Cluster::alone(3).unwrap().service_cidr, SERVICE_CIDR);
        assert_eq!(Cluster::alone(1).unwrap().sites, vec![Site::single()]);
    }

    #[test]
    fn a_node_in_a_namespace_reaches_the_api_server_on_the_link() {
        let admin = "clusters:\n- name: x\n  cluster:\n    server: https://127.0.0.1:6443\n    certificate-authority-data: abc\n";
        let kubeconfig = node_kubeconfig(admin, LINK_HOST);
        assert!(kubeconfig.contains("    server: https://198.18.100.1:6443\n"));
        assert!(kubeconfig.contains("    tls-server-name: kubernetes\n"));
        assert!(kubeconfig.contains("certificate-authority-data: abc"));
        let kubelet = kubelet(&layout(Site::of_several(1)));
        assert!(kubelet.contains("cgroupRoot: /steward-node-1\n"));
        assert!(kubelet.contains("clusterDNS: [198.18.100.1]"));
        assert!(kubelet.contains("healthzBindAddress: 198.18.100.3"));
    }

    #[test]
    fn cgroup_v1_and_oom_traps_are_configured() {
        let kubelet = kubelet(&layout(Site::single()));
        assert!(kubelet.contains("failCgroupV1: false"));
        assert!(kubelet.contains("cgroupDriver: cgroupfs"));
        assert!(kubelet.contains("failSwapOn: false"));
        assert!(!kubelet.contains("cgroupRoot"));
        let containerd = containerd(&layout(Site::single()), "steward.dev/testenv/pause:1");
        assert!(containerd.contains("restrict_oom_score_adj = true"));
        assert!(containerd.contains("sandbox = \"steward.dev/testenv/pause:1\""));
        let cni: serde_json::Value = serde_json::from_str(&cni_conflist(&Site::single())).unwrap();
        assert_eq!(cni["plugins"][0]["ipMasq"], false);
        assert_eq!(cni["name"], "steward");
    }
}
