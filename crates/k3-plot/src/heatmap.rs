//! Heatmaps as PNG: one coloured cell per matrix entry, a colour bar with its range, and labels.
//! Sequential maps run white → blue; diverging maps run blue → white → red around a centre.

use crate::{fmt_tick, png, Canvas};

/// A matrix to draw: `values[row][col]`; NaN cells are drawn grey.
#[derive(Debug, Clone, Default)]
pub struct Heatmap {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub values: Vec<Vec<f64>>,
    /// Labels of the rows (drawn left of the matrix; empty to number them from 0).
    pub row_labels: Vec<String>,
    /// `Some(c)`: a diverging map centred on `c` (e.g. 1 for a ratio to a baseline, 0 for a
    /// log-ratio); `None`: sequential from the minimum to the maximum.
    pub centre: Option<f64>,
}

fn lerp(a: [u8; 3], b: [u8; 3], t: f64) -> [u8; 3] {
    let t = t.clamp(0.0, 1.0);
    [0, 1, 2].map(|i| (a[i] as f64 + (b[i] as f64 - a[i] as f64) * t).round() as u8)
}

const BLUE: [u8; 3] = [33, 102, 172];
const RED: [u8; 3] = [178, 24, 43];
const WHITE: [u8; 3] = [247, 247, 247];

/// The colour of `v` on the map spanning `lo..hi` (diverging around `centre` when given).
fn colour(v: f64, lo: f64, hi: f64, centre: Option<f64>) -> [u8; 3] {
    if !v.is_finite() {
        return [160, 160, 160];
    }
    match centre {
        Some(c) => {
            let span = (hi - c).abs().max((c - lo).abs()).max(1e-12);
            let t = (v - c) / span;
            if t >= 0.0 {
                lerp(WHITE, RED, t)
            } else {
                lerp(WHITE, BLUE, -t)
            }
        }
        None => lerp(WHITE, BLUE, (v - lo) / (hi - lo).max(1e-12)),
    }
}

/// Render a heatmap to PNG bytes; cells are sized to fit about 900×(rows) pixels.
pub fn render_heatmap(map: &Heatmap) -> Vec<u8> {
    let rows = map.values.len().max(1);
    let cols = map.values.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let cw = (900 / cols).clamp(2, 40);
    let ch = (480 / rows).clamp(4, 40);
    let (left, top, bottom, right) = (80usize, 30usize, 50usize, 120usize);
    let w = (left + cols * cw + right).max(6 * map.title.len() + 20);
    let h = top + rows * ch + bottom;
    let mut cv = Canvas::new(w, h);
    let finite = map.values.iter().flatten().copied().filter(|v| v.is_finite());
    let (lo, hi) = finite.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo > hi { (0.0, 1.0) } else { (lo, hi) };
    for (r, row) in map.values.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            let col = colour(v, lo, hi, map.centre);
            for y in 0..ch {
                for x in 0..cw {
                    cv.set((left + c * cw + x) as i64, (top + r * ch + y) as i64, col);
                }
            }
        }
        let label = map.row_labels.get(r).cloned().unwrap_or_else(|| r.to_string());
        if ch >= 8 || r % (8 / ch).max(1) == 0 {
            cv.text((left - 6 - 6 * label.len()) as i64, (top + r * ch + ch / 2) as i64 - 3, &label, [20; 3]);
        }
    }
    let ink = [20, 20, 20];
    let step = cols.div_ceil(16).max(1);
    for c in (0..cols).step_by(step) {
        let label = c.to_string();
        cv.text((left + c * cw + cw / 2) as i64 - 3 * label.len() as i64, (top + rows * ch + 6) as i64, &label, ink);
    }
    cv.text((w / 2) as i64 - 3 * map.title.len() as i64, 10, &map.title, ink);
    cv.text((left + cols * cw / 2) as i64 - 3 * map.x_label.len() as i64, (h - 16) as i64, &map.x_label, ink);
    cv.text_vertical(10, (top + rows * ch / 2 + 3 * map.y_label.len()) as i64, &map.y_label, ink);
    // Colour bar: top is the maximum (or the far end of a diverging map).
    let (bar_lo, bar_hi) = match map.centre {
        Some(c) => {
            let span = (hi - c).abs().max((c - lo).abs());
            (c - span, c + span)
        }
        None => (lo, hi),
    };
    let (bx, bh) = (left + cols * cw + 20, rows * ch);
    for y in 0..bh {
        let v = bar_hi - (bar_hi - bar_lo) * y as f64 / (bh.max(2) - 1) as f64;
        let col = colour(v, lo, hi, map.centre);
        for x in 0..14 {
            cv.set((bx + x) as i64, (top + y) as i64, col);
        }
    }
    cv.text((bx + 18) as i64, top as i64, &fmt_tick(bar_hi), ink);
    cv.text((bx + 18) as i64, (top + bh) as i64 - 7, &fmt_tick(bar_lo), ink);
    if let Some(c) = map.centre {
        cv.text((bx + 18) as i64, (top + bh / 2) as i64 - 3, &fmt_tick(c), ink);
    }
    png::encode_rgb(w, h, &cv.px)
}

/// Render and write atomically (temp file + rename).
pub fn write_heatmap(path: &std::path::Path, map: &Heatmap) -> std::io::Result<()> {
    let tmp = path.with_extension("png.tmp");
    std::fs::write(&tmp, render_heatmap(map))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diverging_map_is_white_at_the_centre_and_saturates_at_the_far_end() {
        assert_eq!(colour(1.0, 0.0, 3.0, Some(1.0)), WHITE);
        assert_eq!(colour(3.0, 0.0, 3.0, Some(1.0)), RED);
        assert_eq!(colour(f64::NAN, 0.0, 3.0, None), [160, 160, 160]);
    }

    #[test]
    fn renders_a_png_of_the_expected_size() {
        let map = Heatmap { values: vec![vec![0.0, 1.0, 2.0], vec![3.0, f64::NAN, 5.0]], ..Default::default() };
        let png = render_heatmap(&map);
        assert_eq!(&png[1..4], b"PNG");
        // IHDR width/height, big-endian, after the 8-byte signature and 8-byte chunk header.
        let w = u32::from_be_bytes(png[16..20].try_into().expect("w")) as usize;
        assert_eq!(w, 80 + 3 * 40 + 120);
    }
}
