//! Line charts and heatmaps as PNG: a raster canvas, a 5×7 bitmap font for labels, and a minimal PNG encoder
//! (deflate from miniz_oxide, the only dependency). Good enough for loss curves and benchmark plots
//! that a person looks at.

mod font;
mod heatmap;
mod png;

pub use heatmap::{render_heatmap, write_heatmap, Heatmap};
pub use png::encode_rgb;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub color: [u8; 3],
}

/// A line chart.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub log_x: bool,
    pub log_y: bool,
}

/// A palette for series that do not care.
pub const COLORS: [[u8; 3]; 6] =
    [[31, 119, 180], [214, 39, 40], [44, 160, 44], [255, 127, 14], [148, 103, 189], [23, 190, 207]];

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Self { w, h, px: vec![255; w * h * 3] }
    }
    fn set(&mut self, x: i64, y: i64, c: [u8; 3]) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }
    fn line(&mut self, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: [u8; 3], thick: i64) {
        let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as i64).max(1);
        for i in 0..=n {
            let t = i as f64 / n as f64;
            let (x, y) = ((x0 + t * (x1 - x0)).round() as i64, (y0 + t * (y1 - y0)).round() as i64);
            for dx in 0..thick {
                for dy in 0..thick {
                    self.set(x + dx - thick / 2, y + dy - thick / 2, c);
                }
            }
        }
    }
    fn text(&mut self, x: i64, y: i64, s: &str, c: [u8; 3]) {
        for (i, ch) in s.chars().enumerate() {
            let cols = font::glyph(ch);
            for (cx, col) in cols.iter().enumerate() {
                for row in 0..7 {
                    if col >> row & 1 == 1 {
                        self.set(x + i as i64 * 6 + cx as i64, y + row, c);
                    }
                }
            }
        }
    }
    fn text_vertical(&mut self, x: i64, y: i64, s: &str, c: [u8; 3]) {
        // bottom-to-top, rotated 90° counter-clockwise
        for (i, ch) in s.chars().enumerate() {
            let cols = font::glyph(ch);
            for (cx, col) in cols.iter().enumerate() {
                for row in 0..7 {
                    if col >> row & 1 == 1 {
                        self.set(x + row, y - i as i64 * 6 - cx as i64, c);
                    }
                }
            }
        }
    }
}

/// A tick label: short, with k/M suffixes for large values.
pub fn fmt_tick(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        let m = format!("{:.3}", v / 1e6);
        format!("{}M", m.trim_end_matches('0').trim_end_matches('.'))
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 || v == v.trunc() {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi <= lo {
        return vec![lo];
    }
    let raw = (hi - lo) / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = vec![];
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

/// Render a chart to PNG bytes.
pub fn render(chart: &Chart, width: usize, height: usize) -> Vec<u8> {
    let mut cv = Canvas::new(width, height);
    let (left, right, top, bottom) = (70.0, 170.0, 30.0, 50.0);
    let (pw, ph) = (width as f64 - left - right, height as f64 - top - bottom);
    let tx = |v: f64, log: bool| if log { v.max(1e-300).log10() } else { v };
    let pts: Vec<(f64, f64)> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(x, y)| (tx(x, chart.log_x), tx(y, chart.log_y))))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in &pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    if pts.is_empty() {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 - x0 < 1e-12 {
        x1 = x0 + 1.0;
    }
    let pad = ((y1 - y0) * 0.05).max(1e-9);
    let (y0, y1) = (y0 - pad, y1 + pad);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + (1.0 - (y - y0) / (y1 - y0)) * ph;
    let (grid, axis, ink) = ([230, 230, 230], [90, 90, 90], [20, 20, 20]);
    for t in nice_ticks(y0, y1, 6) {
        let y = py(t);
        cv.line((left, y), (left + pw, y), grid, 1);
        let label = fmt_tick(if chart.log_y { 10f64.powf(t) } else { t });
        cv.text(left as i64 - 6 - 6 * label.len() as i64, y as i64 - 3, &label, ink);
    }
    for t in nice_ticks(x0, x1, 6) {
        let x = px(t);
        cv.line((x, top), (x, top + ph), grid, 1);
        let label = fmt_tick(if chart.log_x { 10f64.powf(t) } else { t });
        cv.text(x as i64 - 3 * label.len() as i64, (top + ph) as i64 + 8, &label, ink);
    }
    cv.line((left, top), (left, top + ph), axis, 1);
    cv.line((left, top + ph), (left + pw, top + ph), axis, 1);
    cv.text((left + pw / 2.0) as i64 - 3 * chart.title.len() as i64, 10, &chart.title, ink);
    cv.text((left + pw / 2.0) as i64 - 3 * chart.x_label.len() as i64, height as i64 - 16, &chart.x_label, ink);
    cv.text_vertical(12, (top + ph / 2.0) as i64 + 3 * chart.y_label.len() as i64, &chart.y_label, ink);
    for (si, s) in chart.series.iter().enumerate() {
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(x, y)| (tx(x, chart.log_x), tx(y, chart.log_y)))
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect();
        for w in pts.windows(2) {
            cv.line((px(w[0].0), py(w[0].1)), (px(w[1].0), py(w[1].1)), s.color, 2);
        }
        for &(x, y) in &pts {
            if pts.len() <= 40 {
                for dx in -2..=2 {
                    for dy in -2..=2 {
                        cv.set(px(x) as i64 + dx, py(y) as i64 + dy, s.color);
                    }
                }
            }
        }
        let ly = top as i64 + 10 + si as i64 * 14;
        let lx = (left + pw) as i64 + 12;
        cv.line((lx as f64, ly as f64 + 3.0), (lx as f64 + 16.0, ly as f64 + 3.0), s.color, 3);
        cv.text(lx + 22, ly, &s.name, ink);
    }
    png::encode_rgb(width, height, &cv.px)
}

/// Render and write atomically (temp file + rename).
pub fn write_png(path: &std::path::Path, chart: &Chart, width: usize, height: usize) -> std::io::Result<()> {
    let tmp = path.with_extension("png.tmp");
    std::fs::write(&tmp, render(chart, width, height))?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_valid_png() {
        let chart = Chart {
            title: "loss".into(),
            x_label: "tokens".into(),
            y_label: "loss".into(),
            series: vec![Series {
                name: "train".into(),
                points: (0..50).map(|i| (i as f64 * 1e4, 5.0 / (1.0 + i as f64))).collect(),
                color: COLORS[0],
            }],
            ..Default::default()
        };
        let png = render(&chart, 640, 400);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR is 25 bytes after the signature; IDAT follows: inflate it back to the raw rows.
        assert_eq!(&png[37..41], b"IDAT");
        let n = u32::from_be_bytes([png[33], png[34], png[35], png[36]]) as usize;
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&png[41..41 + n]).expect("valid zlib");
        assert_eq!(raw.len(), 400 * (640 * 3 + 1));
        assert!(png.len() < raw.len() / 10, "a mostly white chart compresses well: {} bytes", png.len());
        assert_eq!(fmt_tick(2_500_000.0), "2.5M");
        assert_eq!(fmt_tick(30_000.0), "30k");
    }
}
