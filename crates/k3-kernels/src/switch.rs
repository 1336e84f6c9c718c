//! Engine choices read once from the environment, and settable for the rest of the process
//! (in-process A/B measurements).

use std::sync::atomic::{AtomicU32, Ordering};

/// An engine choice that is off when the environment variable `var` reads `off`, on when it
/// reads anything else, and otherwise on (or what its default function says); read once, and
/// settable for the rest of the process (in-process A/B measurements).
pub struct Switch {
    /// 0 off, 1 on, 2 not read yet.
    state: AtomicU32,
    var: &'static str,
    off: &'static str,
    default: fn() -> bool,
}

impl Switch {
    pub const fn new(var: &'static str, off: &'static str) -> Self {
        Self::by_default(var, off, || true)
    }

    /// A switch whose setting without `var` depends on the machine (`default`, asked once).
    pub const fn by_default(var: &'static str, off: &'static str, default: fn() -> bool) -> Self {
        Self { state: AtomicU32::new(2), var, off, default }
    }

    #[inline]
    pub fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            2 => self.read(),
            v => v == 1,
        }
    }

    /// The first [`Switch::on`]: the environment (or the default) read and kept.
    #[cold]
    fn read(&self) -> bool {
        let on = match std::env::var(self.var) {
            Ok(v) if !v.trim().is_empty() => v.trim() != self.off,
            _ => (self.default)(),
        };
        self.set(on);
        on
    }

    pub fn set(&self, on: bool) {
        self.state.store(u32::from(on), Ordering::Relaxed);
    }
}
