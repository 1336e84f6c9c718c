//! Weight matrices in any ggml storage type. Q4_0 / Q4_1 / Q8_0 matrices are repacked at load for
//! the integer kernels of `k3_kernels::qgemm` (AVX-512 VNNI / AVX2 / scalar); the other types
//! (f32, f16, bf16) and the `exact` reference mode dequantize one row at a time.
//! A [`Matrix`] is `[rows = out, cols = in]`, row-major, the HF layout (= ggml `ne = [in, out]`).

use std::mem::MaybeUninit;
use std::sync::Arc;

use k3_kernels::hugebuf::Place;
use k3_kernels::qgemm::{gemm_rows_out, prefetch_next_band, Isa, OutMat, Packed, QActs};
use k3_kernels::quant::GgmlType;

use crate::threads::par_chunks;
use k3_kernels::threads::{pair_balance, SendPtr};

#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub ty: GgmlType,
    /// Raw rows in `ty`'s encoding, `rows × ty.row_bytes(cols)` bytes; empty once `packed`.
    pub data: Vec<u8>,
    /// The integer kernels' layout of a matrix whose type has them (then the only copy).
    pub packed: Option<Arc<Packed>>,
    /// The GGUF tensor this matrix is (calibration records its inputs under this name).
    pub name: Option<Arc<str>>,
}

impl Matrix {
    /// A matrix from raw ggml rows, repacked for the integer kernels when its type has them
    /// (Q4_K with its 6-bit scales, the Q5 types and Q6_K as nibbles plus high-bit planes:
    /// `Packed::pack`).
    pub fn new(rows: usize, cols: usize, ty: GgmlType, data: Vec<u8>) -> Self {
        debug_assert_eq!(data.len(), rows * ty.row_bytes(cols));
        let packed = Packed::pack(ty, rows, cols, &data, Place::Heap);
        Self::packed_or_raw(rows, cols, ty, packed, || data)
    }

    /// [`Matrix::new`] from borrowed rows (a mapped GGUF tensor): repacked straight from them a
    /// band at a time, or copied when the type has no tiles; every byte is handed to `done` once
    /// it has been read (the loader drops the file's pages).
    pub fn from_ggml(rows: usize, cols: usize, ty: GgmlType, data: &[u8], mut done: impl FnMut(&[u8])) -> Self {
        debug_assert_eq!(data.len(), rows * ty.row_bytes(cols));
        let packed = Packed::pack_bands(ty, rows, cols, data, 2 << 20, &mut done);
        Self::packed_or_raw(rows, cols, ty, packed, || {
            let raw = data.to_vec();
            done(data);
            raw
        })
    }

    /// The packed matrix when the type has tiles (no raw rows kept), else the raw rows.
    fn packed_or_raw(
        rows: usize,
        cols: usize,
        ty: GgmlType,
        packed: Option<Packed>,
        raw: impl FnOnce() -> Vec<u8>,
    ) -> Self {
        match packed {
            Some(p) => Self { rows, cols, ty, data: Vec::new(), packed: Some(Arc::new(p)), name: None },
            None => Self { rows, cols, ty, data: raw(), packed: None, name: None },
        }
    }

    /// An f32 matrix from values in row-major order.
    pub fn from_f32(rows: usize, cols: usize, v: &[f32]) -> Self {
        debug_assert_eq!(v.len(), rows * cols);
        Self { rows, cols, ty: GgmlType::F32, data: GgmlType::F32.quantize_row(v), packed: None, name: None }
    }

    /// The same matrix, named after the GGUF tensor it is.
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }

    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    fn row_raw(&self, r: usize) -> &[u8] {
        let b = self.row_bytes();
        &self.data[r * b..(r + 1) * b]
    }

    /// Dequantize row `r` into `out` [cols].
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        match &self.packed {
            Some(p) => p.dequant_row(r, out),
            None => self.ty.dequantize_row(self.row_raw(r), out),
        }
    }

    /// Rows `start..start+n` as a new matrix (e.g. one head's block of an absorbed MLA matrix).
    pub fn slice_rows(&self, start: usize, n: usize) -> Matrix {
        self.permute_rows(&(start..start + n).collect::<Vec<_>>())
    }

    /// Select rows: `out[i] = self[perm[i]]` (Llama's Q/K un-permutation, head slices).
    pub fn permute_rows(&self, perm: &[usize]) -> Matrix {
        if let Some(p) = &self.packed {
            return Matrix {
                rows: perm.len(),
                cols: self.cols,
                ty: self.ty,
                data: Vec::new(),
                packed: Some(Arc::new(p.select_rows(perm, Place::Heap))),
                name: None,
            };
        }
        let b = self.row_bytes();
        let mut data = Vec::with_capacity(perm.len() * b);
        for &p in perm {
            data.extend_from_slice(&self.data[p * b..(p + 1) * b]);
        }
        Matrix { rows: perm.len(), cols: self.cols, ty: self.ty, data, packed: None, name: None }
    }

    /// Bytes of weight data (for bandwidth figures).
    pub fn nbytes(&self) -> usize {
        self.packed.as_ref().map_or(self.data.len(), |p| p.nbytes())
    }

    /// The integer-kernel path: activations quantized once, row bands on the pool.
    fn matmul_packed(&self, p: &Packed, x: &[f32], t: usize, y: &mut [f32], threads: usize) {
        let acts = QActs::quantize_threads(x, t, self.cols, threads);
        packed_products(&mut [(p, &acts, y)], threads);
    }

    /// `Y[t, o] = Σ_i X[t, i] · W[o, i]` over `t` rows of x.
    ///
    /// Like ggml, a non-f32 weight multiplies an activation row quantized on the fly to the
    /// weight's `vec_dot_type` (Q8_0 / Q8_1 / F16 / BF16) with integer block dots, unless
    /// `cx.exact` asks for f32 activations against the dequantized weight (the reference).
    ///
    /// # Shapes
    /// x: [T, cols] → y: [T, rows]
    pub fn matmul(&self, x: &[f32], t: usize, y: &mut [f32], cx: Compute) {
        debug_assert_eq!(x.len(), t * self.cols);
        debug_assert_eq!(y.len(), t * self.rows);
        if let Some(n) = &self.name {
            crate::calib::record(n, x, t, self.cols);
        }
        let (rows, cols) = (self.rows, self.cols);
        if let (Some(p), false) = (&self.packed, cx.exact) {
            return self.matmul_packed(p, x, t, y, cx.threads);
        }
        let xq = self.row_dot_acts(x, t, cx.exact);
        let work = rows * cols * t;
        let threads = if work < 1 << 16 { 1 } else { cx.threads.max(1) };
        // Work split over output rows; each worker fills a band [rows_lo..hi, T] then it is scattered.
        let parts = par_chunks(rows, threads, |lo, hi| {
            let mut band = vec![0f32; (hi - lo) * t];
            self.row_dots(lo, hi, x, t, &xq, |o, r, v| band[(o - lo) * t + r] = v);
            band
        });
        for (lo, hi, band) in parts {
            for o in lo..hi {
                for r in 0..t {
                    y[r * rows + o] = band[(o - lo) * t + r];
                }
            }
        }
    }

    /// Rows `lo..hi` of `W · x` on the calling thread, token-major: the product of one head's
    /// block of a stacked per-head matrix (MLA's absorbed `W_uk`, `W_uv`), whose heads then lie
    /// in one allocation, a thread's run of heads in one run of memory. The bits of
    /// `self.slice_rows(lo, hi − lo).matmul(x, t, y, cx.single())`, without the copy.
    ///
    /// # Shapes
    /// x: [T, cols] → y: [T, hi − lo]
    pub fn matmul_rows(&self, lo: usize, hi: usize, x: &[f32], t: usize, y: &mut [f32], cx: Compute) {
        let (n, cols) = (hi.saturating_sub(lo), self.cols);
        assert!(
            lo <= hi && hi <= self.rows && x.len() == t * cols && y.len() == t * n,
            "matmul_rows: rows {lo}..{hi} of {} with x of {} and y of {} values (T = {t}, {cols} columns)",
            self.rows,
            x.len(),
            y.len()
        );
        if let (Some(p), false) = (&self.packed, cx.exact) {
            if !lo.is_multiple_of(p.row_align()) {
                // A band the tiles cannot start at (no shape of ours): the copied slice's tiles.
                return self.slice_rows(lo, n).matmul(x, t, y, cx.single());
            }
            let acts = QActs::quantize(x, t, cols);
            // SAFETY: y holds [T, hi − lo] (checked above) and is borrowed exclusively.
            unsafe { gemm_rows_out(Isa::best(), p, &acts, lo, hi, OutMat::token_major(y.as_mut_ptr(), 0, n)) };
            return;
        }
        // As `matmul` does on one thread.
        let xq = self.row_dot_acts(x, t, cx.exact);
        self.row_dots(lo, hi, x, t, &xq, |o, r, v| y[r * n + o - lo] = v);
    }

    /// The activations of the row-dot path ([`Self::row_dots`]): each token's row quantized to
    /// the weight's vec_dot type, as llama.cpp does, or none (`exact`, f32 or packed weights:
    /// f32 dots against dequantized rows).
    fn row_dot_acts(&self, x: &[f32], t: usize, exact: bool) -> Vec<Vec<u8>> {
        if exact || self.ty == GgmlType::F32 || self.packed.is_some() {
            return Vec::new();
        }
        x.chunks_exact(self.cols).take(t).map(|xr| self.ty.quantize_activation(xr)).collect()
    }

    /// Rows `lo..hi` of `W · x` by row dots, without tiles: integer block dots against `xq`
    /// (from [`Self::row_dot_acts`]) or, when it is empty, f32 dots against the dequantized rows;
    /// `put(o, r, value)` receives output row o of token r.
    fn row_dots(
        &self,
        lo: usize,
        hi: usize,
        x: &[f32],
        t: usize,
        xq: &[Vec<u8>],
        mut put: impl FnMut(usize, usize, f32),
    ) {
        let cols = self.cols;
        let mut w = vec![0f32; cols];
        for o in lo..hi {
            if !xq.is_empty() {
                for (r, xr) in xq.iter().enumerate() {
                    put(o, r, self.ty.vec_dot(self.row_raw(o), xr));
                }
                continue;
            }
            let wr: &[f32] = if self.ty == GgmlType::F32 && self.packed.is_none() {
                bytemuck_f32(self.row_raw(o), &mut w)
            } else {
                self.row_into(o, &mut w);
                &w
            };
            for r in 0..t {
                put(o, r, k3_kernels::ops::dot(&x[r * cols..(r + 1) * cols], wr));
            }
        }
    }

    /// `y = W x` for one vector.
    pub fn matvec(&self, x: &[f32], y: &mut [f32], cx: Compute) {
        self.matmul(x, 1, y, cx)
    }

    /// Convenience: a freshly allocated `[T, rows]` output.
    pub fn apply(&self, x: &[f32], t: usize, cx: Compute) -> Vec<f32> {
        let mut y = vec![0f32; t * self.rows];
        self.matmul(x, t, &mut y, cx);
        y
    }

    /// Several matrices applied to the same input (a layer's q / k / v / gate projections):
    /// `[m.apply(x) for m in ms]`, with the activations quantized once and every matrix's row
    /// bands in one pool job when all of them take the integer kernels; else one by one.
    ///
    /// # Shapes
    /// x: [T, cols] → [T, rows_i] for each matrix i
    pub fn apply_many(ms: &[&Matrix], x: &[f32], t: usize, cx: Compute) -> Vec<Vec<f32>> {
        let cols = ms.first().map_or(0, |m| m.cols);
        let packed: Option<Vec<&Packed>> = ms.iter().map(|m| m.packed.as_deref()).collect();
        let packed = match packed {
            Some(p) if !cx.exact && ms.iter().all(|m| m.cols == cols) => p,
            _ => return ms.iter().map(|m| m.apply(x, t, cx)).collect(),
        };
        for m in ms {
            if let Some(n) = &m.name {
                crate::calib::record(n, x, t, cols);
            }
        }
        let acts = QActs::quantize_threads(x, t, cols, cx.threads);
        let mut ys: Vec<Vec<MaybeUninit<f32>>> = ms.iter().map(|m| uninit(t * m.rows)).collect();
        let mut jobs: Vec<(&Packed, &QActs, *mut f32)> =
            packed.into_iter().zip(ys.iter_mut()).map(|(p, y)| (p, &acts, y.as_mut_ptr() as *mut f32)).collect();
        // SAFETY: each output holds T·rows values, and the products write every one of them.
        unsafe { packed_products_into(&mut jobs, cx.threads) };
        ys.into_iter().map(|y| unsafe { assume_written(y) }).collect()
    }
}

/// Tasks per thread of a packed product: few, because each task streams its rows as one
/// sequential read that the prefetcher follows (a one-off sweep over `examples/gemv_stream`'s
/// matrices on the AVX-512-without-VNNI host: 90% of the read probe at one task per thread, 87%
/// at 4, 80% at 16, 2 threads); two when decoding, so a core slowed from outside does not hold
/// the other up for a whole half, and four when prefilling, where the work is compute.
fn tasks_per_thread(t: usize) -> usize {
    if t == 1 {
        1
    } else {
        4
    }
}

/// Cut the matrices' rows, taken in order as one run, into `n` segments of equal work, at the
/// kernels' row tiles: task i is a list of `(matrix, lo, hi)` row ranges, contiguous in that run
/// (a task may end one matrix and start the next).
fn equal_work_tasks(shapes: &[(usize, usize, usize)], n: usize) -> Vec<Vec<(usize, usize, usize)>> {
    let n = n.max(1);
    shared_work_tasks(shapes, &vec![1.0 / n as f32; n])
}

/// [`equal_work_tasks`] with task i taking `shares[i]` of the work (the shares sum to 1): each
/// task ends at the first row tile at or past its running total. Fewer tasks than shares when
/// the work runs out first; never an empty one.
fn shared_work_tasks(shapes: &[(usize, usize, usize)], shares: &[f32]) -> Vec<Vec<(usize, usize, usize)>> {
    let work: usize = shapes.iter().map(|&(rows, cols, _)| rows * cols).sum();
    let mut cum = 0f64;
    // The work assigned once task k is done; the last task takes whatever is left.
    let bounds: Vec<usize> = shares
        .iter()
        .enumerate()
        .map(|(k, &s)| {
            cum += s as f64;
            if k + 1 == shares.len() {
                work
            } else {
                ((work as f64 * cum).ceil() as usize).min(work)
            }
        })
        .collect();
    let mut tasks = vec![Vec::new()];
    let (mut k, mut done) = (0, 0);
    for (j, &(rows, cols, align)) in shapes.iter().enumerate() {
        let mut lo = 0;
        while lo < rows {
            while done >= bounds[k] && k + 1 < bounds.len() {
                k += 1;
                if !tasks.last().is_some_and(Vec::is_empty) {
                    tasks.push(Vec::new());
                }
            }
            let want = (bounds[k] - done.min(bounds[k])).div_ceil(cols.max(1));
            let take = want.next_multiple_of(align).max(align).min(rows - lo);
            tasks.last_mut().expect("one task at least").push((j, lo, lo + take));
            done += take * cols;
            lo += take;
        }
    }
    tasks
}

/// The work of one task of [`shared_work_tasks`].
fn task_work(shapes: &[(usize, usize, usize)], task: &[(usize, usize, usize)]) -> usize {
    task.iter().map(|&(j, lo, hi)| (hi - lo) * shapes[j].1).sum()
}

/// `y = W · acts` for one packed matrix over an input already quantized (`[T, rows]` out), on
/// the pool as [`Matrix::matmul`] runs it.
pub fn packed_product(p: &Packed, acts: &QActs, threads: usize) -> Vec<f32> {
    let mut y = uninit(acts.t * p.rows);
    // SAFETY: y holds T·rows values, and the product writes every one of them.
    unsafe {
        packed_products_into(&mut [(p, acts, y.as_mut_ptr() as *mut f32)], threads);
        assume_written(y)
    }
}

/// `y_i = W_i · acts_i` for packed matrices each on an input of its own, into the given
/// `[T_i, rows_i]` outputs: the products of equal T as one pool job ([`packed_products`]), so
/// every selected expert of a mixture goes to the pool at once (decode: one job for all).
pub fn packed_products_each(jobs: &mut [(&Packed, &QActs, &mut [f32])], threads: usize) {
    let mut ts: Vec<usize> = jobs.iter().map(|j| j.1.t).collect();
    ts.sort_unstable();
    ts.dedup();
    for t in ts {
        let mut group: Vec<(&Packed, &QActs, &mut [f32])> =
            jobs.iter_mut().filter(|j| j.1.t == t).map(|(p, a, y)| (*p, *a, &mut **y)).collect();
        packed_products(&mut group, threads);
    }
}

/// `n` floats not yet written, for a product's output (zeroing what every task then overwrites
/// was ~1–2% of a 4096-token prefill, in memset).
fn uninit(n: usize) -> Vec<MaybeUninit<f32>> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: MaybeUninit needs no initialisation.
    unsafe { v.set_len(n) };
    v
}

/// The floats of `v`, once every one has been written.
///
/// # Safety
/// Every element of `v` must have been written.
unsafe fn assume_written(v: Vec<MaybeUninit<f32>>) -> Vec<f32> {
    let mut v = std::mem::ManuallyDrop::new(v);
    // SAFETY: MaybeUninit<f32> has f32's layout; the caller promises every element is written;
    // the allocation passes whole from one Vec to the other.
    unsafe { Vec::from_raw_parts(v.as_mut_ptr() as *mut f32, v.len(), v.capacity()) }
}

/// `y_i = W_i · acts_i` for packed matrices over quantized inputs of the same T (often one
/// shared input), as one pool job: the matrices' rows cut into a few equal-work tasks per thread
/// ([`equal_work_tasks`]).
fn packed_products(jobs: &mut [(&Packed, &QActs, &mut [f32])], threads: usize) {
    for (p, acts, y) in jobs.iter() {
        assert_eq!(y.len(), acts.t * p.rows, "output of a packed product is [T, rows]");
    }
    let mut raw: Vec<(&Packed, &QActs, *mut f32)> = jobs.iter_mut().map(|(p, a, y)| (*p, *a, y.as_mut_ptr())).collect();
    // SAFETY: each output is a live, exclusively borrowed [T, rows] slice (checked above).
    unsafe { packed_products_into(&mut raw, threads) }
}

/// [`packed_products`] into raw outputs, each written whole.
///
/// # Safety
/// Each output pointer must be valid for T·rows writes of its matrix, and nothing else may
/// access those values while this runs.
unsafe fn packed_products_into(jobs: &mut [(&Packed, &QActs, *mut f32)], threads: usize) {
    let Some(t) = jobs.first().map(|(_, a, _)| a.t) else { return };
    let isa = Isa::best().for_tokens(t);
    let work: usize = jobs.iter().map(|(p, _, _)| p.rows * p.cols * t).sum();
    let threads = if work < 1 << 15 { 1 } else { threads.max(1) };
    let shapes: Vec<(usize, usize, usize)> = jobs.iter().map(|(p, _, _)| (p.rows, p.cols, p.row_align())).collect();
    // A decode product on two threads is a pair: the caller's task first, at the share the
    // balance has learned (k3_kernels::threads::PairBalance).
    let pair = threads == 2 && tasks_per_thread(t) == 1;
    let bal = pair_balance(&jobs[0].0.pair);
    let tasks = if pair {
        let share = bal.share();
        shared_work_tasks(&shapes, &[share, 1.0 - share])
    } else {
        equal_work_tasks(&shapes, if threads == 1 { 1 } else { threads * tasks_per_thread(t) })
    };
    let mut outs = Vec::with_capacity(jobs.len());
    for (p, acts, y) in jobs.iter_mut() {
        assert_eq!(acts.t, t, "the inputs of one packed job have the same T");
        outs.push((*p, *acts, SendPtr(*y)));
    }
    let task = |i: usize| {
        for &(j, _, _) in &tasks[i] {
            outs[j].1.warm();
        }
        for (k, &(j, lo, hi)) in tasks[i].iter().enumerate() {
            if let Some(&(jn, lon, hin)) = tasks[i].get(k + 1) {
                prefetch_next_band(outs[jn].0, lon, hin, t);
            }
            let (p, acts, out) = outs[j];
            // SAFETY: y_j holds [T, rows_j] and no one else touches it during this call (the
            // caller's promise); the segments of all tasks are disjoint and cover every row, so
            // this one alone writes columns lo..hi of every row of y_j, and all are written.
            unsafe { gemm_rows_out(isa, p, acts, lo, hi, OutMat::token_major(out.get(), lo, p.rows)) };
        }
    };
    let pool = crate::threads::Pool::global();
    if pair && tasks.len() == 2 {
        let (w0, w1) = (task_work(&shapes, &tasks[0]), task_work(&shapes, &tasks[1]));
        pool.run_pair(bal, w0 as f32 / (w0 + w1) as f32, &task);
    } else {
        pool.run(threads, tasks.len(), &task);
    }
}

/// How matmuls run: thread count, and whether activations stay f32 (`exact`) or are quantized
/// to the weight's activation type as llama.cpp does (the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compute {
    pub threads: usize,
    pub exact: bool,
}

impl Default for Compute {
    fn default() -> Self {
        Self { threads: 1, exact: false }
    }
}

impl Compute {
    /// Single-threaded, same activation mode.
    pub fn single(self) -> Self {
        Self { threads: 1, ..self }
    }
}

/// View little-endian f32 bytes as floats: in place when they are aligned (always, from the
/// allocator, on a little-endian machine), else copied into `buf`. Copying every row was a MoE
/// decode's largest cost after its products: the f32 router (64 × 1024 a layer) went through
/// memcpy on each token, 2% of `bench-moe`'s 1-thread decode in perf; viewed in place, the
/// decode ran 1.040× as fast at 1 thread (23 of 30 rounds) and 1.011× at 2 (16 of 30), in one
/// process (`examples/decode_ab`, a temporary switch).
fn bytemuck_f32<'a>(b: &'a [u8], buf: &'a mut [f32]) -> &'a [f32] {
    if cfg!(target_endian = "little") {
        // SAFETY: every bit pattern is a valid f32, and align_to only yields the aligned middle.
        let (head, mid, tail) = unsafe { b.align_to::<f32>() };
        if head.is_empty() && tail.is_empty() {
            return mid;
        }
    }
    for (o, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_kernels::testing::{assert_close_abs, Rng};

    /// f32 rows read in place when aligned and copied when not give the same floats.
    #[test]
    fn f32_rows_read_in_place_or_copied_alike() {
        let v: Vec<f32> = (0..33).map(|i| i as f32 * 0.37 - 5.0).collect();
        let bytes = GgmlType::F32.quantize_row(&v);
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        for b in [&bytes[..], &shifted[1..]] {
            let mut buf = vec![0f32; v.len()];
            assert_eq!(bytemuck_f32(b, &mut buf), &v[..]);
        }
    }

    #[test]
    fn matmul_matches_f64_for_every_type() {
        let mut rng = Rng::new(3);
        let (rows, cols, t) = (37, 64, 5);
        let w = rng.normals(rows * cols, 0.5);
        let x = rng.normals(t * cols, 1.0);
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            let m = Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect());
            let mut deq = vec![0f32; cols];
            let mut want = vec![0f32; t * rows];
            for o in 0..rows {
                m.row_into(o, &mut deq);
                for r in 0..t {
                    want[r * rows + o] = (0..cols).map(|i| x[r * cols + i] as f64 * deq[i] as f64).sum::<f64>() as f32;
                }
            }
            for threads in [1, 3] {
                let got = m.apply(&x, t, Compute { threads, exact: true });
                assert_close_abs(&format!("{} x{threads}", ty.name()), &got, &want, 1e-4);
                // ggml's path (activations quantized to vec_dot_type): within the activation
                // rounding (8-bit for the integer types), measured as an RMS-error ratio.
                let q = m.apply(&x, t, Compute { threads, exact: false });
                let tol = if ty == GgmlType::F32 { 1e-6 } else { 2e-2 };
                k3_kernels::testing::assert_close_ratio(
                    &format!("{} quantized acts x{threads}", ty.name()),
                    &q,
                    &want,
                    tol,
                );
            }
        }
    }

    /// Q4_K (repacked as Q4_1 tiles), Q5_K, Q5_1 and Q5_0 (nibble tiles with a high-bit plane;
    /// Q5_0 as Q8_0 in row pairs), Q6_K (two planes, a scale per 16 codes): the quantized product
    /// against the f64 dot of the file's own dequantized rows (for Q4_K that also bounds the f16
    /// rounding of the repacked scales).
    #[test]
    fn k_quant_and_q5_0_matrices_match_their_dequantized_rows() {
        let mut rng = Rng::new(4);
        let (rows, cols, t) = (21, 512, 3);
        let w = rng.normals(rows * cols, 0.5);
        let x = rng.normals(t * cols, 1.0);
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q5_1] {
            let data: Vec<u8> = w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect();
            let m = Matrix::new(rows, cols, ty, data.clone());
            // Q5_K, Q5_1 and Q6_K take 16-row tiles wherever their SIMD kernels run (row dots
            // elsewhere).
            let only16 = matches!(ty, GgmlType::Q5_K | GgmlType::Q5_1 | GgmlType::Q6_K);
            let tiles = !only16 || k3_kernels::qgemm::rows16_simd();
            assert_eq!(m.packed.is_some(), tiles, "{}: packed", ty.name());
            let mut deq = vec![0f32; rows * cols];
            ty.dequantize_row(&data, &mut deq);
            let mut want = vec![0f32; t * rows];
            for o in 0..rows {
                for r in 0..t {
                    let row = &deq[o * cols..(o + 1) * cols];
                    want[r * rows + o] = (0..cols).map(|i| x[r * cols + i] as f64 * row[i] as f64).sum::<f64>() as f32;
                }
            }
            for threads in [1, 2] {
                let q = m.apply(&x, t, Compute { threads, exact: false });
                k3_kernels::testing::assert_close_ratio(&format!("{} x{threads}", ty.name()), &q, &want, 2e-2);
            }
        }
    }

    #[test]
    fn equal_work_tasks_cover_every_row_once_on_tiles() {
        // (rows, cols, row tile): three matrices of unequal work, one not a multiple of its tile.
        let shapes = [(1024, 1024, 16), (8, 1024, 4), (2816, 256, 16), (37, 64, 4)];
        for n in [1, 2, 4, 7, 64] {
            let tasks = equal_work_tasks(&shapes, n);
            let mut seen: Vec<Vec<u8>> = shapes.iter().map(|s| vec![0; s.0]).collect();
            for seg in tasks.iter().flatten() {
                let (j, lo, hi) = *seg;
                assert!(lo < hi && hi <= shapes[j].0, "n={n}: segment {seg:?}");
                assert!(lo % shapes[j].2 == 0, "n={n}: segment {seg:?} starts off its row tile");
                seen[j][lo..hi].iter_mut().for_each(|c| *c += 1);
            }
            assert!(seen.iter().flatten().all(|&c| c == 1), "n={n}: a row missed or repeated");
            // About n tasks, none more than one row tile of work past the fair share.
            let work: usize = shapes.iter().map(|s| s.0 * s.1).sum();
            let fair = work.div_ceil(n);
            assert!(tasks.len() <= n + shapes.len(), "n={n}: {} tasks", tasks.len());
            for task in &tasks {
                let w: usize = task.iter().map(|&(j, lo, hi)| (hi - lo) * shapes[j].1).sum();
                assert!(w <= fair + 16 * 1024, "n={n}: a task of {w} against a share of {fair}");
            }
        }
    }

    #[test]
    fn shared_work_tasks_give_each_task_its_share() {
        let shapes = [(1024, 1024, 16), (8, 1024, 4), (2816, 256, 16), (37, 64, 4)];
        let work: usize = shapes.iter().map(|s| s.0 * s.1).sum();
        for share in [0.5f32, 0.3, 0.537, 0.7, 0.0, 1.0] {
            let tasks = shared_work_tasks(&shapes, &[share, 1.0 - share]);
            let mut seen: Vec<Vec<u8>> = shapes.iter().map(|s| vec![0; s.0]).collect();
            for &(j, lo, hi) in tasks.iter().flatten() {
                assert!(lo < hi && lo % shapes[j].2 == 0, "share {share}: ({j}, {lo}, {hi})");
                seen[j][lo..hi].iter_mut().for_each(|c| *c += 1);
            }
            assert!(seen.iter().flatten().all(|&c| c == 1), "share {share}: a row missed or repeated");
            assert!(tasks.iter().all(|t| !t.is_empty()), "share {share}: an empty task");
            if share > 0.0 && share < 1.0 {
                // Two tasks, the first within one row tile (16 rows of 1024) past its share.
                assert_eq!(tasks.len(), 2, "share {share}");
                let w0 = task_work(&shapes, &tasks[0]) as f64;
                let want = share as f64 * work as f64;
                assert!(w0 >= want - 1.0 && w0 <= want + 16.0 * 1024.0 + 1.0, "share {share}: {w0} for {want}");
            } else {
                assert_eq!(tasks.len(), 1, "share {share}");
            }
        }
    }

    /// A rows × cols matrix of `ty` from normal weights (σ 0.5).
    fn random_matrix(rng: &mut Rng, rows: usize, cols: usize, ty: GgmlType) -> Matrix {
        let w = rng.normals(rows * cols, 0.5);
        Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect())
    }

    #[test]
    fn apply_many_equals_one_product_at_a_time() {
        // One quantized input and one pool job for all: every matrix's output must be exactly
        // what its own product gives, at every thread count, for one token and for many, and
        // with a non-integer matrix in the group (which falls back to one at a time).
        let mut rng = Rng::new(5);
        let cols = 256;
        let mk = |rng: &mut Rng, rows: usize, ty: GgmlType| random_matrix(rng, rows, cols, ty);
        let ms =
            [mk(&mut rng, 300, GgmlType::Q4_0), mk(&mut rng, 8, GgmlType::Q8_0), mk(&mut rng, 130, GgmlType::Q4_1)];
        let f16 = mk(&mut rng, 20, GgmlType::F16);
        for t in [1, 40] {
            let x = rng.normals(t * cols, 1.0);
            for threads in [1, 2, 3] {
                let cx = Compute { threads, exact: false };
                let group: Vec<&Matrix> = ms.iter().collect();
                let got = Matrix::apply_many(&group, &x, t, cx);
                for (m, g) in ms.iter().zip(&got) {
                    assert!(*g == m.apply(&x, t, cx), "T={t} x{threads}: {} rows", m.rows);
                }
                let mixed = Matrix::apply_many(&[&ms[0], &f16], &x, t, cx);
                assert!(mixed[1] == f16.apply(&x, t, cx) && mixed[0] == got[0], "mixed group T={t} x{threads}");
            }
        }
    }

    #[test]
    fn packed_products_each_equal_one_product_at_a_time() {
        // Matrices on inputs of their own, of several T (one job per T), one input shared by
        // two matrices: every output exactly its own product's, at every thread count.
        let mut rng = Rng::new(7);
        let cols = 256;
        let mk = |rng: &mut Rng, rows: usize, ty: GgmlType| random_matrix(rng, rows, cols, ty);
        let ms = [
            mk(&mut rng, 64, GgmlType::Q4_0),
            mk(&mut rng, 48, GgmlType::Q8_0),
            mk(&mut rng, 130, GgmlType::Q4_1),
            mk(&mut rng, 32, GgmlType::Q4_0),
        ];
        let xs = [rng.normals(3 * cols, 1.0), rng.normals(cols, 1.0), rng.normals(5 * cols, 1.0)];
        let acts: Vec<QActs> = xs.iter().map(|x| QActs::quantize(x, x.len() / cols, cols)).collect();
        // (matrix, input)
        let items = [(0, 0), (1, 1), (2, 0), (3, 2), (0, 1)];
        for threads in [1, 2, 3] {
            let cx = Compute { threads, exact: false };
            let mut outs: Vec<Vec<f32>> = items.iter().map(|&(m, x)| vec![f32::NAN; acts[x].t * ms[m].rows]).collect();
            let mut jobs: Vec<(&Packed, &QActs, &mut [f32])> = items
                .iter()
                .zip(outs.iter_mut())
                .map(|(&(m, x), y)| (ms[m].packed.as_deref().expect("packed"), &acts[x], y.as_mut_slice()))
                .collect();
            packed_products_each(&mut jobs, threads);
            for (&(m, x), got) in items.iter().zip(&outs) {
                let t = acts[x].t;
                assert!(*got == ms[m].apply(&xs[x], t, cx), "matrix {m} on input {x} (T={t}) x{threads}");
            }
        }
    }

    #[test]
    fn matmul_rows_equals_the_product_of_the_sliced_rows() {
        // A band of a stacked per-head matrix must give exactly what the copied slice gives:
        // on 16-row tiles (aligned band), off them (the slice fallback), the exact f32 path, and
        // for types without tiles (row dots against quantized activations).
        let mut rng = Rng::new(6);
        let (rows, cols) = (64, 128);
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4_1, GgmlType::F16, GgmlType::F32] {
            let w = rng.normals(rows * cols, 0.5);
            let m = Matrix::new(rows, cols, ty, w.chunks(cols).flat_map(|r| ty.quantize_row(r)).collect());
            for t in [1, 3] {
                let x = rng.normals(t * cols, 1.0);
                for (lo, hi) in [(0, 16), (16, 48), (32, 64), (4, 20), (0, 64), (7, 7)] {
                    for exact in [false, true] {
                        let cx = Compute { threads: 1, exact };
                        let mut got = vec![0f32; t * (hi - lo)];
                        m.matmul_rows(lo, hi, &x, t, &mut got, cx);
                        let mut want = vec![0f32; t * (hi - lo)];
                        m.slice_rows(lo, hi - lo).matmul(&x, t, &mut want, cx);
                        assert!(got == want, "{} rows {lo}..{hi} T={t} exact={exact}", ty.name());
                    }
                }
            }
        }
    }
}
