//! The rendezvous, before any collective: rank 0 serves the store on the address `MASTER_ADDR`
//! names; every rank shows it belongs to this run (its run token) and to its world, claims its
//! rank once (a second process claiming it is refused at once, naming the holder), and the ranks
//! compare their config and build (a config that differs is named field by field). Every wait has
//! the deadline `DFLASH_DIST_TIMEOUT` gives, whatever the peer does.
//!
//! The run token is `DFLASH_RUN_TOKEN` (`train --nproc` sets a random one), else torchrun's
//! `TORCHELASTIC_RUN_ID` (unless it is `none`), else one made from the experiment folder (not
//! the config: ranks whose configs differ belong to one run and are told which fields differ). It
//! tells one run's ranks from another's that reached the same `MASTER_PORT`; it is no
//! secret (anyone who can reach the port can read the store), so the store is served on the
//! loopback when `MASTER_ADDR` is a loopback address.

use super::{DistEnv, Identity};
use anyhow::{anyhow, bail, Result};
use c10d::Store;
use sha2::{Digest, Sha256};
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, ToSocketAddrs},
    time::{Duration, Instant},
};

fn hello_key(rank: usize) -> String {
    format!("dflash/hello/{rank}")
}

fn config_key(rank: usize) -> String {
    format!("dflash/config/{rank}")
}

fn claim_key(rank: usize) -> String {
    format!("dflash/claim/{rank}")
}

/// Rank 0's run token and world size.
const RUN_KEY: &str = "dflash/run";

/// At most this many differing config fields are named.
const MAX_FIELDS: usize = 5;

/// Meet the other ranks: the store (served here on rank 0), this run's and this rank's claim, and
/// the same world, config and build on every rank. Returns the store and its address.
pub(super) fn meet(env: &DistEnv, identity: &Identity) -> Result<(Store, String)> {
    let (rank, world, timeout) = (env.rank, env.world, env.timeout);
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let token = run_token(env, identity);
    // 1. The store, and the run it serves.
    let store = if rank == 0 {
        let store = serve(env, &token)?;
        store.set(RUN_KEY, format!("{token} {world}").as_bytes()).map_err(|e| anyhow!("rank 0: {e}"))?;
        store
    } else {
        let store = Store::connect(&env.master_addr, env.master_port, timeout).map_err(|e| {
            anyhow!(
                "rank 0 gone: rank {rank} could not reach its rendezvous store at {addr} within {} s: {e}",
                timeout.as_secs()
            )
        })?;
        let run = store.get(RUN_KEY).map_err(|e| {
            anyhow!("rank {rank}: the store at {addr} never said which run it serves (is it a dflash run's?): {e}")
        })?;
        let run = String::from_utf8_lossy(&run).into_owned();
        let (theirs, their_world) = run.split_once(' ').unwrap_or((run.as_str(), ""));
        if theirs != token {
            bail!(
                "rank {rank}: the rendezvous store at {addr} serves another run (run token {theirs} there, {token} here); \
                 give each run its own MASTER_PORT, and every rank of a run the same DFLASH_RUN_TOKEN and --exp-dir"
            );
        }
        if their_world != world.to_string() {
            bail!(
                "rank {rank}: WORLD_SIZE {world} here, {their_world} on rank 0; every rank needs the same WORLD_SIZE"
            );
        }
        store
    };
    let rdv = |e: c10d::Error| anyhow!("rank {rank}: rendezvous at {addr}: {e}");
    // 2. This rank, claimed once (the claim is unique to this call: the holder's line, then a
    //    nonce).
    let me = holder();
    let got = store.compare_set(&claim_key(rank), b"", me.as_bytes()).map_err(rdv)?;
    if got != me.as_bytes() {
        bail!(
            "rank {rank} is taken: {} joined this run as rank {rank} first (store at {addr}); every process needs its own RANK",
            String::from_utf8_lossy(&got).lines().next().unwrap_or("")
        );
    }
    // 3. Everyone says who they are, then waits for everyone (naming who never came).
    let hello = format!("world size {world}, config {}, build {}", identity.config, identity.build);
    store.set(&config_key(rank), identity.config_text.as_bytes()).map_err(rdv)?;
    store.set(&hello_key(rank), hello.as_bytes()).map_err(rdv)?;
    let deadline = Instant::now() + timeout;
    loop {
        let mut missing = Vec::new();
        for r in 0..world {
            if !store.check(&hello_key(r)).map_err(rdv)? {
                missing.push(r.to_string());
            }
        }
        if missing.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            let s = if missing.len() > 1 { "s" } else { "" };
            bail!(
                "rank{s} {} did not join the rendezvous at {addr} within {} s (world size {world})",
                missing.join(", "),
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // 4. The same world, config and build everywhere, or one line naming who differs and how. Rank
    //    0 serves the store, so it waits until every rank has read before it may leave.
    let text = |key: String| store.get(&key).map(|v| String::from_utf8_lossy(&v).into_owned()).map_err(rdv);
    let hellos = (0..world).map(|r| text(hello_key(r))).collect::<Result<Vec<_>>>()?;
    let differs = hellos.iter().enumerate().find(|(_, h)| *h != &hellos[0]).map(|(r, h)| (r, h.clone()));
    let configs = match &differs {
        Some((r, theirs)) if field(theirs, "config") != field(&hellos[0], "config") => {
            Some((text(config_key(0))?, text(config_key(*r))?))
        }
        _ => None,
    };
    store.add("dflash/checked", 1).map_err(rdv)?;
    while rank == 0 && store.add("dflash/checked", 0).map_err(rdv)? < world as i64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some((r, theirs)) = differs {
        let fields = configs.map(|(zero, theirs)| config_diff(&zero, &theirs)).unwrap_or_default();
        let diff = if fields.is_empty() {
            hellos[0]
                .split(", ")
                .zip(theirs.split(", "))
                .find(|(a, b)| a != b)
                .map_or_else(|| format!(": `{theirs}` vs `{}`", hellos[0]), |(a, b)| format!(": {b} vs {a} on rank 0"))
        } else {
            format!(" in its config: {}", fields.join(", "))
        };
        bail!("rank {r} differs from rank 0{diff}; every rank must run the same build with the same config");
    }
    Ok((store, addr))
}

/// The value after `name ` in a hello line (`world size 2, config 3f1c…, build 9a0b…`).
fn field<'a>(hello: &'a str, name: &str) -> Option<&'a str> {
    hello.split(", ").find_map(|p| p.strip_prefix(name)?.strip_prefix(' '))
}

/// Who holds a rank: this machine and process, then a line unique to the claim.
fn holder() -> String {
    static CLAIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CLAIMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into the buffer.
    let host = if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "?".into()
    };
    format!("pid {} on {host}\n{now}-{n}", std::process::id())
}

/// This run's token as the store holds it (a short hash): see the module doc.
fn run_token(env: &DistEnv, identity: &Identity) -> String {
    let source = match &env.run_token {
        Some(t) => format!("token {t}"),
        None => format!("experiment {}", identity.experiment),
    };
    Sha256::digest(source.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Rank 0: the store, served on the address `MASTER_ADDR` names.
fn serve(env: &DistEnv, token: &str) -> Result<Store> {
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let listener = match listen(&env.master_addr, env.master_port) {
        Ok(l) => l,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(in_use(env, token)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => bail!(
            "rank 0: MASTER_ADDR {} is not an address of this machine ({e}); rank 0 serves the rendezvous store there, so it must run on the machine MASTER_ADDR names",
            env.master_addr
        ),
        Err(e) => bail!("rank 0: serving the rendezvous store on {addr}: {e}"),
    };
    let on = listener.local_addr().map_or_else(|_| addr.clone(), |a| a.to_string());
    let store = Store::serve(listener, env.timeout)
        .map_err(|e| anyhow!("rank 0: serving the rendezvous store on {addr}: {e}"))?;
    tracing::debug!("rendezvous store on {on}");
    Ok(store)
}

/// A listening socket on the address `host` names: a literal IP as given (127.0.0.1: the loopback
/// only), `localhost` the loopback; a host name the first of its addresses on this machine that
/// is not a loopback one, or every interface where it names only a loopback address here (an
/// /etc/hosts line `127.0.1.1 name`) while other machines reach it under another, as torch does.
pub(super) fn listen(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return TcpListener::bind(SocketAddr::new(ip, port));
    }
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    if host.eq_ignore_ascii_case("localhost") {
        let ip = addrs.iter().find(|a| a.is_ipv4()).map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip());
        return TcpListener::bind(SocketAddr::new(ip, port));
    }
    let mut last = None;
    for a in addrs.iter().filter(|a| !a.ip().is_loopback()) {
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    if let Some(e) = last {
        return Err(e);
    }
    let any: IpAddr =
        if addrs.iter().any(|a| a.is_ipv4()) { Ipv4Addr::UNSPECIFIED.into() } else { Ipv6Addr::UNSPECIFIED.into() };
    TcpListener::bind(SocketAddr::new(any, port))
}

/// Why rank 0 cannot serve on a port that is taken: this run's rank 0 already does, another run
/// does, or another program holds it.
fn in_use(env: &DistEnv, token: &str) -> String {
    let (addr, port) = (format!("{}:{}", env.master_addr, env.master_port), env.master_port);
    let quick = env.timeout.min(Duration::from_secs(5));
    let store = Store::connect(&env.master_addr, port, quick).ok();
    let read = |key: &str| -> Option<String> {
        let s = store.as_ref()?;
        s.check(key).ok()?.then(|| s.get(key).ok()).flatten().map(|v| String::from_utf8_lossy(&v).into_owned())
    };
    match (read(RUN_KEY), read(&claim_key(0))) {
        (Some(run), Some(holder)) if run.split(' ').next() == Some(token) => format!(
            "rank 0 is taken: {} serves this run's rendezvous store at {addr}; every process needs its own RANK",
            holder.lines().next().unwrap_or("")
        ),
        (Some(run), _) => format!(
            "rank 0: MASTER_PORT {port} is taken by another run's rendezvous store at {addr} (run token {}); give this run its own MASTER_PORT",
            run.split(' ').next().unwrap_or("")
        ),
        _ if store.is_some() => {
            format!("rank 0: MASTER_PORT {port} is taken by a c10d store at {addr} that is not a dflash run's; give this run a free MASTER_PORT")
        }
        _ => format!("rank 0: MASTER_PORT {port} on {} is in use by another program; give this run a free MASTER_PORT", env.master_addr),
    }
}

/// The fields (dotted keys) whose values differ between rank 0's config and another rank's, as
/// `key = theirs vs ours on rank 0`; empty when either is not TOML.
pub(super) fn config_diff(rank0: &str, theirs: &str) -> Vec<String> {
    fn flatten(prefix: &str, table: &toml::Table, out: &mut std::collections::BTreeMap<String, String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            match v {
                toml::Value::Table(t) => flatten(&key, t, out),
                v => {
                    out.insert(key, v.to_string());
                }
            }
        }
    }
    let parse = |text: &str| -> Option<std::collections::BTreeMap<String, String>> {
        let mut out = std::collections::BTreeMap::new();
        flatten("", &text.parse::<toml::Table>().ok()?, &mut out);
        Some(out)
    };
    let (Some(zero), Some(other)) = (parse(rank0), parse(theirs)) else { return Vec::new() };
    let unset = "(unset)".to_string();
    let mut keys: Vec<&String> = zero.keys().chain(other.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut fields: Vec<String> = keys
        .into_iter()
        .filter(|k| zero.get(*k) != other.get(*k))
        .map(|k| format!("{k} = {} vs {} on rank 0", other.get(k).unwrap_or(&unset), zero.get(k).unwrap_or(&unset)))
        .collect();
    if fields.len() > MAX_FIELDS {
        let more = fields.len() - MAX_FIELDS;
        fields.truncate(MAX_FIELDS);
        fields.push(format!("and {more} more"));
    }
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_differences_are_named_by_field() {
        let zero = "seed = 1\n[optimizer]\nplugin = \"adamw\"\nlr = 0.003\n[train]\nsteps = 4\n";
        let theirs = "seed = 1\n[optimizer]\nplugin = \"adamw\"\nlr = 0.01\n[train]\nsteps = 4\nwarmup = 2\n";
        assert_eq!(
            config_diff(zero, theirs),
            vec!["optimizer.lr = 0.01 vs 0.003 on rank 0", "train.warmup = 2 vs (unset) on rank 0"]
        );
        assert!(config_diff(zero, zero).is_empty());
        assert!(config_diff("not toml [", zero).is_empty());
        let many: String = (0..8).map(|i| format!("k{i} = {i}\n")).collect();
        let fields = config_diff("", &many);
        assert_eq!(fields.len(), MAX_FIELDS + 1);
        assert_eq!(fields.last().unwrap(), "and 3 more");
    }

    #[test]
    fn the_store_listens_on_the_address_master_addr_names() {
        let ip = |l: TcpListener| l.local_addr().unwrap().ip();
        assert_eq!(ip(listen("127.0.0.1", 0).unwrap()), IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(ip(listen("localhost", 0).unwrap()).is_loopback());
        // An address of no interface here is refused as such.
        let e = listen("192.0.2.1", 0).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrNotAvailable, "{e}");
    }
}
