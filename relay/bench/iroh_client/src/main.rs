//! cursor-sync load over iroh for `relay bench` (relay/bench/sync.py): what a stock 0k-sync
//! client does per request (one bidirectional stream, `u32_be(len) ‖ MessagePack`, FIN, the
//! answer read to FIN), in Rust so the load costs the 2-core machine little next to the relay.
//! A benchmark peer only (crates.io is for those): the relay's own path stays Python.
//!
//! Usage: sync-iroh-bench <endpoint-id>@<host:port> <devices> <window> <warmup_s> <seconds>
//!                        <body_bytes> <push|pull> <seed>
//! Each device is an iroh endpoint of its own (key = device id) that HELLOs (version 1) into
//! the seed's group, then keeps `window` requests in flight. Prints "ready" once every device
//! is HELLO'd, waits for a line on stdin ("go"), and at the end one JSON line: requests
//! answered in the measured window, errors, this process's CPU seconds in the window, and
//! each answered request's latency in ms.
use std::{
    io::BufRead,
    net::SocketAddr,
    str::FromStr,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use iroh::{endpoint::presets, Endpoint, EndpointAddr, EndpointId, RelayMode, TransportAddr};
use rmpv::Value;

const ALPN: &[u8] = b"/0k-sync/1";

fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// A byte string as 0k-sync's serde writes `Vec<u8>` / `[u8; 32]`: an array of integers.
fn byte_arr(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|x| Value::from(*x)).collect())
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("msgpack to a Vec");
    out
}

fn hello(group: &[u8; 32], name: &str) -> Vec<u8> {
    encode(&Value::Array(vec![
        "Hello".into(), 1u8.into(), name.into(), byte_arr(group), 0u8.into(),
    ]))
}

fn push(blob: u128, body: &[u8]) -> Vec<u8> {
    encode(&Value::Array(vec![
        "Push".into(), Value::Binary(blob.to_be_bytes().to_vec()), byte_arr(body), 0u8.into(),
    ]))
}

fn pull() -> Vec<u8> {
    encode(&Value::Array(vec!["Pull".into(), 0u8.into(), 100u8.into()]))
}

/// The answer's tag ("Welcome", "PushAck", ...), or None for the empty-FIN refusal.
fn tag(out: &[u8]) -> Option<String> {
    if out.len() < 4 {
        return None;
    }
    match rmpv::decode::read_value(&mut &out[4..]).ok()? {
        Value::Array(items) => items.first()?.as_str().map(str::to_owned),
        _ => None,
    }
}

async fn request(conn: &iroh::endpoint::Connection, body: &[u8]) -> Result<Vec<u8>> {
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&frame(body)).await?;
    send.finish()?;
    Ok(recv.read_to_end(4 << 20).await?)
}

fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 9 {
        bail!("usage: sync-iroh-bench <id>@<host:port> <devices> <window> <warmup_s> \
               <seconds> <body_bytes> <push|pull> <seed>");
    }
    let (id, addr) = args[1].split_once('@').context("<endpoint-id>@<host:port>")?;
    let relay = EndpointAddr::from_parts(
        EndpointId::from_str(id)?,
        [TransportAddr::Ip(SocketAddr::from_str(addr)?)],
    );
    let devices: usize = args[2].parse()?;
    let window: usize = args[3].parse()?;
    let warmup = Duration::from_secs_f64(args[4].parse()?);
    let seconds = Duration::from_secs_f64(args[5].parse()?);
    let body = vec![0x5au8; args[6].parse()?];
    let pulling = args[7] == "pull";
    let seed: u64 = args[8].parse()?;
    let mut group = [0u8; 32];
    group[..8].copy_from_slice(&seed.to_be_bytes());
    group[8..16].copy_from_slice(b"benchgrp");

    let mut conns = Vec::new();
    let mut endpoints = Vec::new();
    for i in 0..devices {
        let ep = Endpoint::builder(presets::Minimal)
            .relay_mode(RelayMode::Disabled)
            .bind_addr("127.0.0.1:0")?
            .bind()
            .await?;
        let conn = ep.connect(relay.clone(), ALPN).await?;
        let out = request(&conn, &hello(&group, &format!("bench-{i}"))).await?;
        if tag(&out).as_deref() != Some("Welcome") {
            bail!("HELLO not welcomed");
        }
        conns.push(conn);
        endpoints.push(ep);
    }
    println!("ready");
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;

    let t0 = Instant::now();
    let (start, end) = (t0 + warmup, t0 + warmup + seconds);
    let counter = Arc::new(AtomicU64::new(seed << 40));
    let errors = Arc::new(AtomicU64::new(0));
    let lat = Arc::new(Mutex::new(Vec::<f64>::new()));
    let want = if pulling { "PullResponse" } else { "PushAck" };
    let mut tasks = Vec::new();
    for conn in &conns {
        for _ in 0..window {
            let (conn, counter, errors, lat, body) =
                (conn.clone(), counter.clone(), errors.clone(), lat.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < end {
                    let n = counter.fetch_add(1, Ordering::Relaxed);
                    let req = if pulling { pull() } else { push(n as u128, &body) };
                    let t = Instant::now();
                    match request(&conn, &req).await {
                        Ok(out) if tag(&out).as_deref() == Some(want) => {
                            let done = Instant::now();
                            if done >= start && done < end {
                                lat.lock().unwrap().push((done - t).as_secs_f64() * 1000.0);
                            }
                        }
                        _ => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
            }));
        }
    }
    tokio::time::sleep_until(start.into()).await;
    let cpu0 = cpu_seconds();
    tokio::time::sleep_until(end.into()).await;
    let cpu1 = cpu_seconds();
    let _ = tokio::time::timeout(Duration::from_secs(60), futures_join(tasks)).await;
    let lat = lat.lock().unwrap();
    let ms: Vec<String> = lat.iter().map(|x| format!("{x:.3}")).collect();
    println!(
        "{{\"ok\": true, \"acked\": {}, \"errors\": {}, \"cpu_s\": {:.3}, \"latency_ms\": [{}]}}",
        lat.len(), errors.load(Ordering::Relaxed), cpu1 - cpu0, ms.join(",")
    );
    for conn in &conns {
        conn.close(0u32.into(), b"closing");
    }
    for ep in endpoints {
        let _ = tokio::time::timeout(Duration::from_secs(2), ep.close()).await;
    }
    Ok(())
}

async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}
