//! Learning-rate schedules: linear warmup, then WSD (warmup–stable–decay), cosine, or constant.

use crate::trainer::config::{ScheduleKind, ScheduleSection};

/// The learning rate of optimiser step `step` (0-based) out of `total`, peaking at `peak`.
pub fn lr_at(s: &ScheduleSection, peak: f64, step: u64, total: u64) -> f64 {
    let min = peak * s.min_lr_fraction;
    let warm = s.warmup_steps.min(total.saturating_sub(1));
    if step < warm {
        return peak * (step + 1) as f64 / warm as f64;
    }
    match s.kind {
        ScheduleKind::Constant => peak,
        ScheduleKind::Cosine => {
            let span = (total - warm).max(1) as f64;
            let p = ((step - warm) as f64 / span).min(1.0);
            min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
        }
        ScheduleKind::Wsd => {
            let decay = ((total - warm) as f64 * s.decay_fraction).round() as u64;
            let start = total - decay;
            if step < start || decay == 0 {
                peak
            } else {
                // Linear from peak (first decay step) to min (last step).
                let p = (step - start + 1) as f64 / decay as f64;
                peak + (min - peak) * p.min(1.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(kind: ScheduleKind) -> ScheduleSection {
        ScheduleSection { kind, warmup_steps: 10, decay_fraction: 0.2, min_lr_fraction: 0.1 }
    }

    #[test]
    fn warmup_then_shape() {
        let w = sched(ScheduleKind::Wsd);
        assert!((lr_at(&w, 1.0, 0, 110) - 0.1).abs() < 1e-12);
        assert_eq!(lr_at(&w, 1.0, 9, 110), 1.0);
        assert_eq!(lr_at(&w, 1.0, 50, 110), 1.0);
        assert_eq!(lr_at(&w, 1.0, 89, 110), 1.0);
        assert!(lr_at(&w, 1.0, 90, 110) < 1.0);
        assert!((lr_at(&w, 1.0, 109, 110) - 0.1).abs() < 1e-12);
        let c = sched(ScheduleKind::Cosine);
        assert!((lr_at(&c, 1.0, 10, 110) - 1.0).abs() < 1e-12);
        assert!((lr_at(&c, 1.0, 60, 110) - 0.55).abs() < 1e-12);
        assert!(lr_at(&c, 1.0, 109, 110) > 0.1);
        for s in 0..110 {
            assert!(lr_at(&c, 1.0, s, 110) > 0.0 && lr_at(&w, 1.0, s, 110) > 0.0);
        }
    }
}
