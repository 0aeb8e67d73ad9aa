//! Removing everything a real node leaves on the host, in order: processes (kubelet,
//! containerd, shims, containers, kube-proxy, CoreDNS), mounts, network namespaces, cgroups,
//! iptables chains, the bridge, files, and the sysctls the node changed.
//!
//! The same sweep runs before real nodes start (after a crash the components die with the
//! test process, but shims, containers, mounts and chains stay) and when the last control
//! plane holding the machine drops its nodes: once for a control plane alone, once for both
//! of a pair (before the first starts, after the second is dropped; one dropped before the
//! other stops its own nodes' processes with [`kill_site`]).
//! Everything it touches is found by fixed names ([`NODE_ROOT`], [`NODE_RUN`], [`BRIDGE`] and
//! [`LINK_BRIDGE`] with their veths, network namespaces `steward-node-*`, chains named
//! `KUBE-*`, `CNI-*`, `STEWARD-*`, cgroups named `kubepods` and `steward-node-*`), which is
//! why only one set of real nodes (one control plane's, or a pair's) runs on a machine at a
//! time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::config::{LINK_BRIDGE, Site};
use super::{BRIDGE, NODE_NAME, NODE_ROOT, NODE_RUN};

/// sysctls the node changes (itself or through kubelet), restored by [`sweep`].
pub(crate) const SYSCTLS: &[&str] = &[
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
    "net/ipv4/conf/all/route_localnet",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Where the sysctl values before the node started are kept until [`sweep`] restores them.
pub(crate) fn sysctl_record() -> PathBuf {
    Path::new(NODE_ROOT).join("sysctl-before")
}

/// Records the current values of [`SYSCTLS`] (unless a record of an earlier node exists).
pub(crate) fn record_sysctls() -> std::io::Result<()> {
    let path = sysctl_record();
    if path.exists() {
        return Ok(());
    }
    std::fs::create_dir_all(NODE_ROOT)?;
    let mut text = String::new();
    for name in SYSCTLS {
        if let Ok(value) = std::fs::read_to_string(Path::new("/proc/sys").join(name)) {
            text.push_str(&format!("{name}={}\n", value.trim()));
        }
    }
    std::fs::write(path, text)
}

/// Chain-name prefixes of kube-proxy, kubelet, the CNI plugins and the harness.
const CHAIN_PREFIXES: &[&str] = &["KUBE-", "CNI-", "STEWARD-"];

/// Removes everything of a real node from the host. Returns what could not be removed (empty
/// when the host is clean). `kube_proxy` runs `kube-proxy --cleanup` when given.
pub(crate) fn sweep(kube_proxy: Option<&Path>) -> Vec<String> {
    let mut problems = Vec::new();
    kill_node_processes(&mut problems);
    unmount_all(&mut problems);
    remove_netns(&mut problems);
    remove_cgroups(&mut problems);
    if let Some(kube_proxy) = kube_proxy {
        let _ = Command::new(kube_proxy).arg("--cleanup").output();
    }
    remove_chains(&mut problems);
    remove_links(&mut problems);
    restore_sysctls(&mut problems);
    remove_shared_files();
    remove_files(&mut problems);
    problems
}

/// Directories outside [`NODE_ROOT`] and [`NODE_RUN`] that a node creates (fixed paths of
/// kubelet, containerd's shims and the CNI library); removed when empty after the sweep.
const SHARED_DIRS: &[&str] = &[
    "/run/containerd/s",
    "/run/containerd/runc/k8s.io",
    "/run/containerd/runc",
    "/run/containerd",
    "/run/netns",
    "/var/lib/cni/results",
    "/var/lib/cni",
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet",
    "/var/log/containers",
    "/var/log/pods",
];

/// What is left of a node on the host (processes, mounts, netns, cgroups, chains, links,
/// directories); empty when clean. The teardown tests assert it.
pub fn leftovers() -> Vec<String> {
    let mut found = Vec::new();
    for pid in node_pids() {
        found.push(format!(
            "process {pid}: {}",
            cmdline(pid).unwrap_or_default()
        ));
    }
    for mount in node_mounts() {
        found.push(format!("mount {mount}"));
    }
    for ns in netns_entries() {
        found.push(format!("netns {}", ns.display()));
    }
    for cgroup in kubepods_cgroups() {
        found.push(format!("cgroup {}", cgroup.display()));
    }
    for tool in ["iptables-save", "ip6tables-save"] {
        if let Ok(out) = Command::new(tool).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if line.starts_with(':') && is_node_chain(&line[1..]) {
                    found.push(format!("{tool}: chain {line}"));
                }
            }
        }
    }
    for bridge in [BRIDGE, LINK_BRIDGE] {
        if Path::new("/sys/class/net").join(bridge).exists() {
            found.push(format!("bridge {bridge}"));
        }
    }
    for link in veths_of_bridge(BRIDGE)
        .into_iter()
        .chain(veths_of_bridge(LINK_BRIDGE))
    {
        found.push(format!("veth {link}"));
    }
    for dir in [NODE_ROOT, NODE_RUN].iter().chain(SHARED_DIRS) {
        if Path::new(dir).exists() {
            found.push(format!("directory {dir}"));
        }
    }
    found.dedup();
    found
}

/// The sites whose directories exist: the single node's, and those of several nodes.
fn sites_on_disk() -> Vec<Site> {
    let mut sites = vec![Site::single()];
    for index in 0..super::MAX_NODES {
        let site = Site::of_several(index);
        if site.run.exists() || site.root.exists() {
            sites.push(site);
        }
    }
    sites
}

/// Ids of a node's sandboxes and containers, read from its containerd's directories.
fn container_ids(site: &Site) -> Vec<String> {
    let mut ids = Vec::new();
    for dir in [
        site.run
            .join("containerd/io.containerd.runtime.v2.task/k8s.io"),
        site.root
            .join("containerd/io.containerd.grpc.v1.cri/sandboxes"),
        site.root
            .join("containerd/io.containerd.grpc.v1.cri/containers"),
    ] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            ids.extend(
                entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string()),
            );
        }
    }
    ids.sort();
    ids.dedup();
    ids
}

/// Files the nodes leave at fixed paths: shim sockets (`/run/containerd/s/<sha256 of socket,
/// namespace, id>`), the CNI library's result cache, kubelet's log links. Then the
/// [`SHARED_DIRS`] that are empty.
fn remove_shared_files() {
    use sha2::{Digest, Sha256};
    for site in sites_on_disk() {
        let socket = site.containerd_socket();
        for id in container_ids(&site) {
            let key = socket.join("k8s.io").join(&id);
            let name = hex::encode(Sha256::digest(key.to_string_lossy().as_bytes()));
            let _ = std::fs::remove_file(Path::new("/run/containerd/s").join(name));
            let _ = std::fs::remove_dir_all(Path::new("/run/containerd/runc/k8s.io").join(&id));
            if let Ok(entries) = std::fs::read_dir("/var/lib/cni/results") {
                for entry in entries.flatten() {
                    let file = entry.file_name().to_string_lossy().to_string();
                    if file.contains(&id) {
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir("/var/log/containers") {
        for entry in entries.flatten() {
            if std::fs::read_link(entry.path()).is_ok_and(|t| t.starts_with(NODE_ROOT)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    // A shim killed between containerd removing its container's directory and the shim
    // removing its socket leaves one no container id names.
    remove_dead_sockets(Path::new("/run/containerd/s"));
    // kubelet's device-plugin socket directory is fixed (not under its root dir).
    let _ = std::fs::remove_dir_all("/var/lib/kubelet/device-plugins");
    // `ip netns add` (several nodes) bind-mounts /run/netns onto itself; once it holds no
    // network namespace it goes like the other directories.
    let empty = std::fs::read_dir("/run/netns").is_ok_and(|mut d| d.next().is_none());
    if empty {
        let _ = Command::new("umount").arg("/run/netns").output();
    }
    for dir in SHARED_DIRS {
        let _ = std::fs::remove_dir(dir);
    }
}

/// Removes the sockets in `dir` nobody listens on. A socket a live process serves (a shim of
/// another containerd on a developer's machine) accepts the connection and stays.
fn remove_dead_sockets(dir: &Path) {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let is_socket = entry.file_type().is_ok_and(|t| t.is_socket());
        let dead = || {
            std::os::unix::net::UnixStream::connect(entry.path())
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
        };
        if is_socket && dead() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

fn is_node_chain(name: &str) -> bool {
    CHAIN_PREFIXES.iter().any(|p| name.starts_with(p))
}

fn cmdline(pid: u32) -> Option<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
}

/// Processes of the nodes: their components and shims (their command lines name [`NODE_RUN`])
/// and every process in a `kubepods` cgroup (the containers).
fn node_pids() -> Vec<u32> {
    pids_of(NODE_RUN, &kubepods_cgroups())
}

/// Processes whose command line names `dir`, and those in `cgroups`.
fn pids_of(dir: &str, cgroups: &[PathBuf]) -> Vec<u32> {
    let me = std::process::id();
    let mut pids: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
                .filter(|pid| *pid != me)
                .filter(|pid| cmdline(*pid).is_some_and(|c| c.contains(dir)))
                .collect()
        })
        .unwrap_or_default();
    for cgroup in cgroups {
        if let Ok(text) = std::fs::read_to_string(cgroup.join("cgroup.procs")) {
            pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    pids.sort_unstable();
    pids.dedup();
    pids.retain(|pid| *pid != me);
    pids
}

/// SIGKILLs what `pids` finds until it finds nothing; returns what survived 10 s of it.
fn kill_all(pids: impl Fn() -> Vec<u32>) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let pids = pids();
        if pids.is_empty() {
            return Vec::new();
        }
        if Instant::now() > deadline {
            return vec![format!("processes still running after SIGKILL: {pids:?}")];
        }
        let _ = Command::new("kill")
            .arg("-KILL")
            .args(pids.iter().map(u32::to_string))
            .output();
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn kill_node_processes(problems: &mut Vec<String>) {
    problems.extend(kill_all(node_pids));
}

/// SIGKILLs every process of one node of several: its components and shims (their command
/// lines name its directory) and its pods' processes (in its cgroup root). Returns what
/// survived.
pub(crate) fn kill_site(site: &Site) -> Vec<String> {
    let dir = format!("{}/", site.run.display());
    let root = site.cgroup_root.clone().unwrap_or_default();
    kill_all(|| {
        let cgroups: Vec<PathBuf> = kubepods_cgroups()
            .into_iter()
            .filter(|c| !root.is_empty() && cgroup_path(c).starts_with(&format!("{root}/")))
            .collect();
        pids_of(&dir, &cgroups)
    })
}

/// A cgroup directory's path within its hierarchy (`/sys/fs/cgroup/memory/a/b` → `/a/b`).
fn cgroup_path(dir: &Path) -> String {
    let within: PathBuf = dir
        .strip_prefix("/sys/fs/cgroup")
        .map(|p| p.components().skip(1).collect())
        .unwrap_or_default();
    format!("/{}", within.display())
}

/// The host side of the veth pair of network namespace `name` (a node's is named after it;
/// at most 15 characters).
pub(crate) fn host_veth(name: &str) -> String {
    format!("stw-{}", name.trim_start_matches("steward-"))
}

/// The v1 hierarchies kubelet uses (every one mounted under `/sys/fs/cgroup` but the v2
/// `unified`).
fn hierarchies() -> Vec<PathBuf> {
    std::fs::read_dir("/sys/fs/cgroup")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name() != "unified" && e.path().is_dir())
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Creates cgroup `root` (`/steward-node-1`) in every hierarchy, as kubelet requires of its
/// `cgroupRoot`; a new cpuset gets its parent's CPUs and memory nodes (it has none).
pub(crate) fn create_cgroup_root(root: &str) -> std::io::Result<()> {
    for hierarchy in hierarchies() {
        let dir = hierarchy.join(root.trim_start_matches('/'));
        std::fs::create_dir_all(&dir)?;
        if hierarchy.ends_with("cpuset") {
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let parent = std::fs::read_to_string(hierarchy.join(file))?;
                std::fs::write(dir.join(file), parent.trim())?;
            }
        }
    }
    Ok(())
}

/// The cgroup roots of several nodes (`<hierarchy>/steward-node-*`).
fn node_cgroup_roots() -> Vec<PathBuf> {
    let prefix = format!("{NODE_NAME}-");
    let mut roots = Vec::new();
    for hierarchy in hierarchies() {
        if let Ok(entries) = std::fs::read_dir(&hierarchy) {
            roots.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .map(|e| e.path()),
            );
        }
    }
    roots
}

/// `kubepods` cgroup directories of every v1 hierarchy (the single node's at its root, those
/// of several nodes in their cgroup roots), deepest first.
fn kubepods_cgroups() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    walk(&entry.path(), out);
                }
            }
        }
        out.push(dir.to_path_buf());
    }
    let mut out = Vec::new();
    for parent in hierarchies().into_iter().chain(node_cgroup_roots()) {
        let pods = parent.join("kubepods");
        if pods.is_dir() {
            walk(&pods, &mut out);
        }
    }
    out
}

fn remove_cgroups(problems: &mut Vec<String>) {
    let all = || {
        let mut all = kubepods_cgroups();
        all.extend(node_cgroup_roots());
        all
    };
    for _ in 0..20 {
        let left: Vec<PathBuf> = all()
            .into_iter()
            .filter(|dir| std::fs::remove_dir(dir).is_err())
            .collect();
        if left.is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for dir in all() {
        problems.push(format!("cannot remove cgroup {}", dir.display()));
    }
}

/// Mount points under the node's directories or in `/run/netns/cni-*`, deepest first.
fn node_mounts() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts: Vec<String> = text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount)
        .filter(|m| {
            m.starts_with(NODE_ROOT)
                || m.starts_with(NODE_RUN)
                || m.starts_with("/run/netns/cni-")
                || m.starts_with("/var/run/netns/cni-")
                || m.starts_with(&format!("/run/netns/{NODE_NAME}-"))
                || m.starts_with(&format!("/var/run/netns/{NODE_NAME}-"))
                || m.starts_with("/var/lib/kubelet")
        })
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    mounts.dedup();
    mounts
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mount(field: &str) -> String {
    let mut out = String::new();
    let mut chars = field.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\\' {
            let code: String = chars.by_ref().take(3).collect();
            if let Ok(byte) = u8::from_str_radix(&code, 8) {
                out.push(byte as char);
                continue;
            }
            out.push(c);
            out.push_str(&code);
        } else {
            out.push(c);
        }
    }
    out
}

fn unmount_all(problems: &mut Vec<String>) {
    for _ in 0..10 {
        let mounts = node_mounts();
        if mounts.is_empty() {
            return;
        }
        for mount in &mounts {
            let _ = Command::new("umount").arg("-l").arg(mount).output();
        }
    }
    for mount in node_mounts() {
        problems.push(format!("cannot unmount {mount}"));
    }
}

fn netns_entries() -> Vec<PathBuf> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name().is_some_and(|n| {
                        let n = n.to_string_lossy();
                        n.starts_with("cni-") || n.starts_with(&format!("{NODE_NAME}-"))
                    })
                })
                .collect()
        })
        .unwrap_or_default()
}

fn remove_netns(problems: &mut Vec<String>) {
    for ns in netns_entries() {
        if let Err(e) = std::fs::remove_file(&ns) {
            problems.push(format!("cannot remove {}: {e}", ns.display()));
        }
    }
}

/// Rewrites each iptables table without the node's chains and the rules that jump to them
/// (one `iptables-restore` per family, only when something is to be removed).
fn remove_chains(problems: &mut Vec<String>) {
    for (save, restore) in [
        ("iptables-save", "iptables-restore"),
        ("ip6tables-save", "ip6tables-restore"),
    ] {
        let Ok(out) = Command::new(save).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let filtered = without_node_chains(&text);
        if filtered == text {
            continue;
        }
        let result = Command::new(restore)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                if let Some(mut stdin) = child.stdin.take() {
                    stdin.write_all(filtered.as_bytes())?;
                }
                child.wait_with_output()
            });
        match result {
            Ok(o) if o.status.success() => {}
            Ok(o) => problems.push(format!(
                "{restore} failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => problems.push(format!("cannot run {restore}: {e}")),
        }
    }
}

/// `iptables-save` output without the node's chains, their rules and jumps to them.
pub(crate) fn without_node_chains(save: &str) -> String {
    let mut out = String::new();
    for line in save.lines() {
        let drop = if let Some(chain) = line.strip_prefix(':') {
            is_node_chain(chain)
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let mut words = rule.split_whitespace();
            let chain = words.next().unwrap_or_default();
            let mut target = None;
            while let Some(w) = words.next() {
                if w == "-j" || w == "-g" {
                    target = words.next();
                }
            }
            is_node_chain(chain) || target.is_some_and(is_node_chain)
        } else {
            false
        };
        if !drop {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn veths_of_bridge(bridge: &str) -> Vec<String> {
    let dir = Path::new("/sys/class/net").join(bridge).join("brif");
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn remove_links(problems: &mut Vec<String>) {
    for bridge in [BRIDGE, LINK_BRIDGE] {
        for veth in veths_of_bridge(bridge) {
            let _ = Command::new("ip").args(["link", "del", &veth]).output();
        }
        if Path::new("/sys/class/net").join(bridge).exists() {
            match Command::new("ip").args(["link", "del", bridge]).output() {
                Ok(o) if o.status.success() => {}
                Ok(o) => problems.push(format!(
                    "ip link del {bridge}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => problems.push(format!("cannot run ip: {e}")),
            }
        }
    }
}

fn restore_sysctls(problems: &mut Vec<String>) {
    let Ok(text) = std::fs::read_to_string(sysctl_record()) else {
        return;
    };
    for line in text.lines() {
        if let Some((name, value)) = line.split_once('=') {
            let path = Path::new("/proc/sys").join(name);
            let now = std::fs::read_to_string(&path).unwrap_or_default();
            if now.trim() != value && std::fs::write(&path, value).is_err() {
                problems.push(format!("cannot restore sysctl {name}={value}"));
            }
        }
    }
}

fn remove_files(problems: &mut Vec<String>) {
    for dir in [NODE_RUN, NODE_ROOT] {
        if Path::new(dir).exists()
            && let Err(e) = std::fs::remove_dir_all(dir)
        {
            problems.push(format!("cannot remove {dir}: {e}"));
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_dead_socket_is_removed_and_a_served_one_stays() {
        let dir = tempfile::tempdir().unwrap();
        let dead = dir.path().join("dead");
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let served = dir.path().join("served");
        let _listener = std::os::unix::net::UnixListener::bind(&served).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"not a socket").unwrap();
        remove_dead_sockets(dir.path());
        assert!(!dead.exists());
        assert!(served.exists());
        assert!(file.exists());
    }

    use super::*;

    #[test]
    fn node_chains_and_jumps_are_dropped_others_kept() {
        let save = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:DOCKER - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A FORWARD -m comment --comment \"kube x\" -j KUBE-FORWARD\n-A FORWARD -j DOCKER\n-A KUBE-FIREWALL -j DROP\n-A FORWARD -j STEWARD-NODE\nCOMMIT\n";
        assert_eq!(
            without_node_chains(save),
            "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:DOCKER - [0:0]\n-A FORWARD -j DOCKER\nCOMMIT\n"
        );
    }

    #[test]
    fn a_node_has_a_short_veth_and_its_cgroups_are_found_by_path() {
        let pair = crate::node::Cluster::pair([1, crate::node::MAX_NODES - 1]).unwrap();
        let namespaces = (0..crate::node::MAX_NODES)
            .map(|index| Site::of_several(index).netns)
            .chain(
                pair.iter()
                    .map(|c| c.services.clone().and_then(|s| s.netns)),
            )
            .flatten();
        for netns in namespaces {
            let veth = host_veth(&netns);
            assert!(veth.len() <= 15, "{veth}");
        }
        assert_eq!(
            cgroup_path(Path::new(
                "/sys/fs/cgroup/memory/steward-node-1/kubepods/pod1"
            )),
            "/steward-node-1/kubepods/pod1"
        );
    }

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mount("/a\\040b"), "/a b");
        assert_eq!(unescape_mount("/plain"), "/plain");
    }
}
