//! The fixed pipeline scheduler: one producer (the data loader) numbers jobs in data order, N
//! workers (target forward passes, one thread per device) turn jobs into features, and the
//! consumer (the drafter trainer) takes them from a buffer bounded in bytes. No barriers: each
//! stage runs as fast as its inputs and the buffer's room allow.
//!
//! Room in the buffer is reserved by the producer, in job order, *before* a worker starts: so the
//! buffer never holds more than its cap, and the job the consumer waits for always has its room
//! (no deadlock when `deterministic` makes the consumer take jobs strictly in order).
//!
//! Failures: an error or panic in any stage is passed to the consumer as an error naming the
//! stage; leaving the consumer (error, panic or done) closes the buffer, which stops the producer
//! and the workers; every thread is joined before `run` returns. Nothing hangs.

use anyhow::{anyhow, Result};
use crossbeam_channel::{bounded, unbounded, Receiver};
use std::{
    collections::BTreeMap,
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Condvar, Mutex,
    },
    thread,
    time::Instant,
};

/// Bytes in the buffer: reserved by the producer, released when the consumer drops an item.
pub struct ByteBudget {
    cap: usize,
    state: Mutex<BudgetState>,
    changed: Condvar,
}

#[derive(Default)]
struct BudgetState {
    used: usize,
    peak: usize,
    closed: bool,
}

impl ByteBudget {
    pub fn new(cap: usize) -> Self {
        Self { cap, state: Mutex::default(), changed: Condvar::new() }
    }

    /// Wait for room for `bytes`; false once the pipeline is closing.
    fn reserve(&self, bytes: usize) -> bool {
        let mut s = self.state.lock().expect("budget lock");
        while !s.closed && s.used + bytes > self.cap {
            s = self.changed.wait(s).expect("budget lock");
        }
        if s.closed {
            return false;
        }
        s.used += bytes;
        s.peak = s.peak.max(s.used);
        true
    }

    fn release(&self, bytes: usize) {
        self.state.lock().expect("budget lock").used -= bytes;
        self.changed.notify_all();
    }

    fn close(&self) {
        self.state.lock().expect("budget lock").closed = true;
        self.changed.notify_all();
    }

    pub fn used(&self) -> usize {
        self.state.lock().expect("budget lock").used
    }

    pub fn peak(&self) -> usize {
        self.state.lock().expect("budget lock").peak
    }
}

/// An item's room in the buffer, given back when the item is dropped.
struct BufferSlot {
    budget: Arc<ByteBudget>,
    bytes: usize,
}

impl Drop for BufferSlot {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

/// A worker's output, with its place in data order.
pub struct Ready<T> {
    pub seq: u64,
    pub worker: usize,
    pub item: T,
    _slot: BufferSlot,
}

pub struct PipelineOptions {
    /// Buffer cap in bytes.
    pub buffer_bytes: usize,
    /// Hand items to the consumer in job order whatever the workers' timing.
    pub deterministic: bool,
}

/// A job from the producer: its payload and the bytes its output will hold in the buffer.
pub struct Job<J> {
    pub payload: J,
    pub bytes: usize,
}

/// What the consumer reads from: items in order (deterministic) or as they come, plus the
/// figures the metrics need.
pub struct Feed<T> {
    rx: Receiver<Result<Ready<T>>>,
    pending: BTreeMap<u64, Ready<T>>,
    next_seq: u64,
    deterministic: bool,
    budget: Arc<ByteBudget>,
    busy_ns: Arc<Vec<AtomicU64>>,
    /// Seconds the consumer spent waiting for an item.
    pub wait_s: f64,
}

impl<T> Feed<T> {
    /// The next item; None when the producer is done and every item was taken.
    // Not an Iterator: taking an item can fail (a stage's error), which `Iterator::next` cannot say.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<Ready<T>>> {
        loop {
            if self.deterministic {
                if let Some(r) = self.pending.remove(&self.next_seq) {
                    self.next_seq += 1;
                    return Ok(Some(r));
                }
            }
            let waiting = Instant::now();
            let got = self.rx.recv();
            self.wait_s += waiting.elapsed().as_secs_f64();
            match got {
                Ok(Ok(r)) if self.deterministic => {
                    self.pending.insert(r.seq, r);
                }
                Ok(Ok(r)) => return Ok(Some(r)),
                Ok(Err(e)) => return Err(e),
                Err(_) if self.pending.is_empty() => return Ok(None),
                Err(_) => return Err(anyhow!("pipeline: job {} never arrived", self.next_seq)),
            }
        }
    }

    /// Items finished and waiting for the consumer (the buffer's depth, `q_hs`).
    pub fn depth(&self) -> usize {
        self.rx.len() + self.pending.len()
    }

    /// Bytes reserved in the buffer now, and at most so far.
    pub fn bytes(&self) -> (usize, usize) {
        (self.budget.used(), self.budget.peak())
    }

    /// Seconds each worker has spent working.
    pub fn worker_busy_s(&self) -> Vec<f64> {
        self.busy_ns.iter().map(|n| n.load(Ordering::Relaxed) as f64 * 1e-9).collect()
    }
}

/// Closes the pipeline when the consumer leaves, even by a panic.
struct Closer<'a>(&'a ByteBudget, &'a AtomicBool);

impl Drop for Closer<'_> {
    fn drop(&mut self) {
        self.1.store(true, Ordering::Relaxed);
        self.0.close();
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// A named stage function.
pub struct Worker<'a, J, T> {
    pub name: String,
    pub work: Box<dyn FnMut(J) -> Result<T> + Send + 'a>,
}

/// Run producer -> workers -> consumer until the producer is done and the consumer returns (or
/// any stage fails). Returns the consumer's result.
pub fn run<'a, J: Send, T: Send, R>(
    opts: &PipelineOptions,
    mut producer: impl FnMut() -> Result<Option<Job<J>>> + Send + 'a,
    workers: Vec<Worker<'a, J, T>>,
    consumer: impl FnOnce(&mut Feed<T>) -> Result<R>,
) -> Result<R> {
    assert!(!workers.is_empty(), "a pipeline needs a worker");
    let budget = Arc::new(ByteBudget::new(opts.buffer_bytes));
    let stop = AtomicBool::new(false);
    let busy_ns: Arc<Vec<AtomicU64>> = Arc::new(workers.iter().map(|_| AtomicU64::new(0)).collect());
    thread::scope(|s| {
        let (job_tx, job_rx) = bounded::<(u64, J, BufferSlot)>(workers.len());
        let (out_tx, out_rx) = unbounded::<Result<Ready<T>>>();

        // 1. Producer: number jobs, reserve their room, hand them out.
        let (tx, budget_p, cap) = (out_tx.clone(), Arc::clone(&budget), opts.buffer_bytes);
        s.spawn(move || {
            for seq in 0.. {
                let job = match catch_unwind(AssertUnwindSafe(&mut producer)) {
                    Ok(Ok(Some(job))) => job,
                    Ok(Ok(None)) => break,
                    Ok(Err(e)) => {
                        let _ = tx.send(Err(e.context("data loader")));
                        break;
                    }
                    Err(p) => {
                        let _ = tx.send(Err(anyhow!("data loader panicked: {}", panic_message(p))));
                        break;
                    }
                };
                if job.bytes > cap {
                    let _ = tx.send(Err(anyhow!(
                        "one batch's features take {:.1} MiB, more than the hidden-state buffer's cap of {:.1} MiB: raise `pipeline.buffer_mb`",
                        job.bytes as f64 / 1048576.0,
                        cap as f64 / 1048576.0
                    )));
                    break;
                }
                if !budget_p.reserve(job.bytes) {
                    break;
                }
                let slot = BufferSlot { budget: Arc::clone(&budget_p), bytes: job.bytes };
                if job_tx.send((seq, job.payload, slot)).is_err() {
                    break;
                }
            }
        });

        // 2. Workers: jobs -> features, each on its own thread.
        for (i, mut w) in workers.into_iter().enumerate() {
            let (rx, tx, busy, stop) = (job_rx.clone(), out_tx.clone(), Arc::clone(&busy_ns), &stop);
            s.spawn(move || {
                for (seq, job, slot) in rx.iter() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let started = Instant::now();
                    // A CUDA out-of-memory panic of the host's own calls becomes the error's one
                    // paragraph (printed once, where the run's error is); any other panic is caught
                    // here.
                    let place = format!("target worker {i} ({})", w.name);
                    let work = &mut w.work;
                    let out = catch_unwind(AssertUnwindSafe(|| {
                        crate::memory_estimate::catch_host_panic(&place, || work(job))
                    }));
                    busy[i].fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    let sent = match out {
                        Ok(Ok(item)) => tx.send(Ok(Ready { seq, worker: i, item, _slot: slot })).is_ok(),
                        Ok(Err(e)) => {
                            let _ = tx.send(Err(e.context(format!("target worker {i} ({})", w.name))));
                            false
                        }
                        Err(p) => {
                            let _ =
                                tx.send(Err(anyhow!("target worker {i} ({}) panicked: {}", w.name, panic_message(p))));
                            false
                        }
                    };
                    if !sent {
                        break;
                    }
                }
            });
        }
        drop((out_tx, job_rx));

        // 3. Consumer, on this thread.
        let _closer = Closer(&budget, &stop);
        let mut feed = Feed {
            rx: out_rx,
            pending: BTreeMap::new(),
            next_seq: 0,
            deterministic: opts.deterministic,
            budget: Arc::clone(&budget),
            busy_ns: Arc::clone(&busy_ns),
            wait_s: 0.0,
        };
        consumer(&mut feed)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A stage starting or ending on a batch (its place in data order).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Event {
        TargetStart(u64),
        TargetEnd(u64),
        DrafterStart(u64),
        DrafterEnd(u64),
    }

    /// The stages' events in the order they happened; a stage can wait for another's event.
    #[derive(Default)]
    struct Events {
        seen: Mutex<Vec<Event>>,
        changed: Condvar,
        /// Set when a wait gave up: the stages do not overlap, and no later wait need be long.
        stuck: AtomicBool,
    }

    impl Events {
        fn push(&self, e: Event) {
            self.seen.lock().unwrap().push(e);
            self.changed.notify_all();
        }

        /// Wait until `e` has happened. The limit only keeps a broken scheduler from hanging
        /// the suite: a pipeline that overlaps its stages gets there at once.
        fn wait_for(&self, e: Event) {
            let limit = Duration::from_secs(if self.stuck.load(Ordering::Relaxed) { 0 } else { 60 });
            let seen = self.seen.lock().unwrap();
            let (seen, waited) = self.changed.wait_timeout_while(seen, limit, |s| !s.contains(&e)).unwrap();
            drop(seen);
            if waited.timed_out() {
                self.stuck.store(true, Ordering::Relaxed);
            }
        }

        fn at(&self, e: Event) -> Option<usize> {
            self.seen.lock().unwrap().iter().position(|&x| x == e)
        }
    }

    /// The stages overlap, shown by the order of their events rather than by a clock (no
    /// threshold a loaded machine could miss): with 1-3 target workers, the target forward of
    /// batch k+1 starts before the drafter's step on batch k ends (the drafter trains while the
    /// targets compute), and with 2 or more workers two batches' forwards run at once. Each
    /// stage waits for the event that overlapping allows, so a scheduler that ran the stages
    /// one after the other would never see it, and fails here. Speed is `bench train`'s.
    #[test]
    fn the_stages_overlap_for_one_to_three_targets() {
        use Event::*;
        let jobs = 20u64;
        for n in 1..=3usize {
            let events = Events::default();
            let opts = PipelineOptions { buffer_bytes: 4 * 100, deterministic: true };
            let mut produced = 0;
            let producer = move || {
                produced += 1;
                Ok((produced <= jobs).then_some(Job { payload: produced - 1, bytes: 100 }))
            };
            let workers = (0..n)
                .map(|i| {
                    let events = &events;
                    Worker {
                        name: format!("target-{i}"),
                        work: Box::new(move |k: u64| {
                            events.push(TargetStart(k));
                            if n > 1 && k + 1 < jobs {
                                events.wait_for(TargetStart(k + 1));
                            }
                            events.push(TargetEnd(k));
                            Ok(k)
                        }) as Box<dyn FnMut(u64) -> Result<u64> + Send + '_>,
                    }
                })
                .collect();
            let order = run(&opts, producer, workers, |feed| {
                let mut order = Vec::new();
                while let Some(r) = feed.next()? {
                    events.push(DrafterStart(r.seq));
                    if r.seq + 1 < jobs {
                        events.wait_for(TargetStart(r.seq + 1));
                    }
                    events.push(DrafterEnd(r.seq));
                    order.push(r.seq);
                    assert!(feed.bytes().0 <= 400);
                }
                Ok(order)
            })
            .unwrap();
            assert_eq!(order, (0..jobs).collect::<Vec<_>>(), "{n} targets: deterministic order");
            let at = |e: Event| events.at(e).unwrap_or_else(|| panic!("{n} targets: no {e:?}"));
            for k in 0..jobs - 1 {
                assert!(
                    at(TargetStart(k + 1)) < at(DrafterEnd(k)),
                    "{n} targets: the forward of batch {} started only after the drafter's step on batch {k} ended",
                    k + 1
                );
                if n > 1 {
                    assert!(
                        at(TargetStart(k + 1)) < at(TargetEnd(k)),
                        "{n} targets: batches {k} and {} were never computed at once",
                        k + 1
                    );
                }
                assert!(at(TargetEnd(k)) < at(DrafterStart(k)), "{n} targets: batch {k} trained before its features");
            }
        }
    }

    #[test]
    fn the_buffer_never_exceeds_its_cap_and_fast_producers_wait() {
        let budget_cap = 300;
        let opts = PipelineOptions { buffer_bytes: budget_cap, deterministic: false };
        let mut n = 0u64;
        let producer = move || {
            n += 1;
            Ok((n <= 50).then_some(Job { payload: n, bytes: 100 }))
        };
        let workers = (0..3)
            .map(|i| Worker { name: format!("w{i}"), work: Box::new(Ok) as Box<dyn FnMut(u64) -> Result<u64> + Send> })
            .collect();
        let (count, peak) = run(&opts, producer, workers, |feed| {
            let mut count = 0;
            while let Some(_r) = feed.next()? {
                thread::sleep(Duration::from_millis(2)); // a slow drafter: the buffer fills
                assert!(feed.depth() <= 3);
                count += 1;
            }
            Ok((count, feed.bytes().1))
        })
        .unwrap();
        assert_eq!(count, 50);
        assert_eq!(peak, budget_cap, "the buffer filled up to its cap and no further");
    }

    #[test]
    fn a_failing_worker_stops_the_pipeline_with_its_name() {
        let opts = PipelineOptions { buffer_bytes: 1000, deterministic: true };
        let mut n = 0u64;
        let producer = move || {
            n += 1;
            Ok(Some(Job { payload: n, bytes: 10 })) // endless: only the failure can stop it
        };
        let mk = |i: usize, fail: bool| Worker {
            name: format!("cpu-{i}"),
            work: Box::new(move |j: u64| {
                // Worker 0 fails on whichever late job it gets (jobs go to whoever is free).
                thread::sleep(Duration::from_millis(1));
                if fail && j >= 7 && j % 2 == 0 {
                    anyhow::bail!("deliberate failure on job {j}");
                }
                if fail && j >= 7 {
                    panic!("boom");
                }
                Ok(j)
            }) as Box<dyn FnMut(u64) -> Result<u64> + Send>,
        };
        let err = run(&opts, producer, vec![mk(0, true), mk(1, false)], |feed| {
            while feed.next()?.is_some() {}
            Ok(())
        })
        .unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("target worker 0 (cpu-0)") && (msg.contains("deliberate failure") || msg.contains("boom")),
            "{msg}"
        );
    }

    #[test]
    fn a_failing_consumer_or_producer_stops_every_thread() {
        let opts = PipelineOptions { buffer_bytes: 50, deterministic: false };
        let producer = || Ok(Some(Job { payload: 1u64, bytes: 10 }));
        let workers =
            vec![Worker { name: "w".into(), work: Box::new(Ok) as Box<dyn FnMut(u64) -> Result<u64> + Send> }];
        let err = run(&opts, producer, workers, |feed| -> Result<()> {
            feed.next()?;
            anyhow::bail!("drafter failed")
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "drafter failed");

        let mut n = 0;
        let producer = move || {
            n += 1;
            if n == 5 {
                anyhow::bail!("bad record");
            }
            Ok(Some(Job { payload: 1u64, bytes: 10 }))
        };
        let workers =
            vec![Worker { name: "w".into(), work: Box::new(Ok) as Box<dyn FnMut(u64) -> Result<u64> + Send> }];
        let err = run(&opts, producer, workers, |feed| {
            while feed.next()?.is_some() {}
            Ok(())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("data loader: bad record"), "{err:#}");

        let producer = || Ok(Some(Job { payload: 1u64, bytes: 51 }));
        let workers =
            vec![Worker { name: "w".into(), work: Box::new(Ok) as Box<dyn FnMut(u64) -> Result<u64> + Send> }];
        let err = run(&opts, producer, workers, |feed| feed.next().map(|_| ())).unwrap_err();
        assert!(err.to_string().contains("raise `pipeline.buffer_mb`"), "{err}");
    }
}
