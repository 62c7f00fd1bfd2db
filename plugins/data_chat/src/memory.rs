//! For the tests: the test binary's allocator, counting per thread the bytes live and the peak,
//! with a ceiling a test can arm so that a broken limit fails its allocation (and the test
//! process) instead of taking the machine's memory. Other threads' allocations are not counted,
//! so tests running side by side do not disturb each other's measure.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
};

struct Meter;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static CEILING: Cell<usize> = const { Cell::new(usize::MAX) };
}

// SAFETY: every call goes to the system allocator; the counters are plain thread-local cells
// (const-initialised, no destructor, so they never allocate themselves).
unsafe impl GlobalAlloc for Meter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !grow(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        shrink(layout.size());
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() && !grow(new_size - layout.size()) {
            return std::ptr::null_mut();
        }
        if new_size < layout.size() {
            shrink(layout.size() - new_size);
        }
        System.realloc(ptr, layout, new_size)
    }
}

/// Counts `n` more bytes on this thread; false when that would pass its ceiling.
fn grow(n: usize) -> bool {
    let counted = LIVE.try_with(|live| {
        let now = live.get().saturating_add(n);
        if now > CEILING.try_with(Cell::get).unwrap_or(usize::MAX) {
            return false;
        }
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        true
    });
    counted.unwrap_or(true)
}

fn shrink(n: usize) {
    let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(n)));
}

#[global_allocator]
static METER: Meter = Meter;

/// Runs `f` on this thread with at most `ceiling` bytes allocated beyond what is live now, and
/// returns its result with the most it had allocated at once (bytes above the start).
pub fn measure<T>(ceiling: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    CEILING.with(|c| c.set(start.saturating_add(ceiling)));
    let out = f();
    CEILING.with(|c| c.set(usize::MAX));
    (out, PEAK.with(Cell::get) - start)
}
