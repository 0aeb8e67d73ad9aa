//! The real node's configuration files, as pure functions of a [`Layout`] (unit-tested).

use std::path::PathBuf;

use super::{
    BRIDGE, CLUSTER_DOMAIN, GATEWAY, NODE_NAME, NODE_ROOT, NODE_RUN, POD_CIDR, SERVICE_CIDR,
};

/// Where the node's files and endpoints are.
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    /// The control plane's admin kubeconfig (kubelet, kube-proxy and CoreDNS use it).
    pub kubeconfig: PathBuf,
    /// Directory of containerd-shim-runc-v2 (containerd is told its path).
    pub shim: PathBuf,
    /// `runc` from Debian's package.
    pub runc: PathBuf,
    /// CNI plugin directory from Debian's `containernetworking-plugins`.
    pub cni_bin: PathBuf,
    /// Loopback ports for health and metrics endpoints.
    pub kubelet_healthz_port: u16,
    pub proxy_healthz_port: u16,
    pub proxy_metrics_port: u16,
    pub coredns_health_port: u16,
    pub coredns_ready_port: u16,
}

impl Layout {
    pub(crate) fn containerd_socket() -> PathBuf {
        PathBuf::from(NODE_RUN).join("containerd.sock")
    }
    pub(crate) fn containerd_config() -> PathBuf {
        PathBuf::from(NODE_RUN).join("containerd.toml")
    }
    pub(crate) fn cni_conf_dir() -> PathBuf {
        PathBuf::from(NODE_RUN).join("cni")
    }
    pub(crate) fn kubelet_config() -> PathBuf {
        PathBuf::from(NODE_RUN).join("kubelet.yaml")
    }
    pub(crate) fn kubelet_root() -> PathBuf {
        PathBuf::from(NODE_ROOT).join("kubelet")
    }
    pub(crate) fn proxy_config() -> PathBuf {
        PathBuf::from(NODE_RUN).join("kube-proxy.yaml")
    }
    pub(crate) fn corefile() -> PathBuf {
        PathBuf::from(NODE_RUN).join("Corefile")
    }
    pub(crate) fn resolv_conf() -> PathBuf {
        PathBuf::from(NODE_RUN).join("resolv.conf")
    }
}

/// containerd 2 (config version 3): state under the node's own directories, the sandbox image
/// pinned to the locally built pause image, runc from Debian, CNI from Debian.
pub(crate) fn containerd(layout: &Layout, pause_reference: &str) -> String {
    let socket = Layout::containerd_socket();
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
        root = NODE_ROOT,
        run = NODE_RUN,
        socket = socket.display(),
        shim = layout.shim.display(),
        runc = layout.runc.display(),
        cni_bin = layout.cni_bin.display(),
        cni_conf = Layout::cni_conf_dir().display(),
    )
}

/// The pod network: Debian's `bridge` plugin on the harness's bridge (gateway = the node's
/// address), `host-local` addresses in [`POD_CIDR`], a route to [`SERVICE_CIDR`] only and no
/// masquerade (nothing leaves the machine), plus `portmap` for hostPorts.
pub(crate) fn cni_conflist() -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": "steward",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": format!("{NODE_ROOT}/cni-ipam"),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": GATEWAY}]],
                    // Only Services go through the gateway: pods have no route off the machine.
                    "routes": [{"dst": SERVICE_CIDR}]
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    })
    .to_string()
}

/// KubeletConfiguration for a cgroup v1 host without swap accounting, with anonymous access
/// (the API server reaches it on the bridge address) and no image garbage collection (images
/// cannot be pulled again).
pub(crate) fn kubelet(layout: &Layout) -> String {
    format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {GATEWAY}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://{socket}
clusterDNS: [{GATEWAY}]
clusterDomain: {CLUSTER_DOMAIN}
resolvConf: {resolv}
podLogsDir: {NODE_ROOT}/pod-logs
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
        healthz = layout.kubelet_healthz_port,
        socket = Layout::containerd_socket().display(),
        resolv = Layout::resolv_conf().display(),
    )
}

/// KubeProxyConfiguration: iptables mode, endpoints on loopback, NodePorts only on the bridge
/// address, and no host-wide conntrack or `route_localnet` sysctl changes.
pub(crate) fn kube_proxy(layout: &Layout) -> String {
    format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {NODE_NAME}
bindAddress: {GATEWAY}
healthzBindAddress: 127.0.0.1:{healthz}
metricsBindAddress: 127.0.0.1:{metrics}
mode: iptables
clusterCIDR: {POD_CIDR}
nodePortAddresses: ["{GATEWAY}/32"]
oomScoreAdj: 0
iptables:
  localhostNodePorts: false
  minSyncPeriod: 0s
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = layout.kubeconfig.display(),
        healthz = layout.proxy_healthz_port,
        metrics = layout.proxy_metrics_port,
    )
}

/// CoreDNS on the bridge address: the cluster domain and reverse zones from the API, nothing
/// forwarded (no name outside the cluster resolves; nothing leaves the machine).
pub(crate) fn corefile(layout: &Layout) -> String {
    format!(
        r#".:53 {{
    bind {GATEWAY}
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
        health = layout.coredns_health_port,
        ready = layout.coredns_ready_port,
        kubeconfig = layout.kubeconfig.display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            kubeconfig: "/tmp/kc".into(),
            shim: "/cache/containerd-shim-runc-v2".into(),
            runc: "/usr/sbin/runc".into(),
            cni_bin: "/usr/lib/cni".into(),
            kubelet_healthz_port: 1,
            proxy_healthz_port: 2,
            proxy_metrics_port: 3,
            coredns_health_port: 4,
            coredns_ready_port: 5,
        }
    }

    #[test]
    fn addresses_stay_in_the_benchmarking_range() {
        for text in [
            containerd(&layout(), "p:1"),
            cni_conflist(),
            kubelet(&layout()),
            kube_proxy(&layout()),
            corefile(&layout()),
        ] {
            for word in text.split(|c: char| !(c.is_ascii_digit() || c == '.')) {
                let octets: Vec<u8> = word.split('.').filter_map(|o| o.parse().ok()).collect();
                if octets.len() == 4 && word.split('.').count() == 4 {
                    let ok = octets[0] == 127 || (octets[0] == 198 && (octets[1] & 0xfe) == 18);
                    assert!(ok, "address {word} outside 127/8 and 198.18/15 in:\n{text}");
                }
            }
        }
    }

    #[test]
    fn cgroup_v1_and_oom_traps_are_configured() {
        let kubelet = kubelet(&layout());
        assert!(kubelet.contains("failCgroupV1: false"));
        assert!(kubelet.contains("cgroupDriver: cgroupfs"));
        assert!(kubelet.contains("failSwapOn: false"));
        let containerd = containerd(&layout(), "steward.dev/testenv/pause:1");
        assert!(containerd.contains("restrict_oom_score_adj = true"));
        assert!(containerd.contains("sandbox = \"steward.dev/testenv/pause:1\""));
        let cni: serde_json::Value = serde_json::from_str(&cni_conflist()).unwrap();
        assert_eq!(cni["plugins"][0]["ipMasq"], false);
    }
}
