// A line chart of percentages over time on a canvas, drawn here: no
// charting library.

/** Draws `series` ([{points: [[time ms, percent]], color}]) on `canvas`,
 *  0 to 100 % high, over the time the points span. */
export function drawChart(canvas, series) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  canvas.width = Math.round(w * ratio);
  canvas.height = Math.round(h * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const pad = { left: 36, right: 8, top: 8, bottom: 18 };
  const pw = w - pad.left - pad.right, ph = h - pad.top - pad.bottom;

  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#5b6470";
  g.strokeStyle = "#e3e7ec";
  g.lineWidth = 1;
  for (const pct of [0, 25, 50, 75, 100]) {
    const y = pad.top + ph - (pct / 100) * ph;
    g.beginPath(); g.moveTo(pad.left, y); g.lineTo(pad.left + pw, y); g.stroke();
    g.fillText(`${pct}%`, 2, y + 4);
  }
  const all = series.flatMap((s) => s.points);
  if (all.length < 1) { g.fillText("no samples yet", pad.left + 8, pad.top + 16); return; }
  const t0 = Math.min(...all.map((p) => p[0])), t1 = Math.max(...all.map((p) => p[0]));
  const span = Math.max(t1 - t0, 1);
  g.fillText(new Date(t0).toLocaleTimeString(), pad.left, h - 4);
  const end = new Date(t1).toLocaleTimeString();
  g.fillText(end, pad.left + pw - g.measureText(end).width, h - 4);
  for (const s of series) {
    g.strokeStyle = s.color;
    g.lineWidth = 2;
    g.beginPath();
    s.points.forEach(([t, v], i) => {
      const x = pad.left + ((t - t0) / span) * pw;
      const y = pad.top + ph - (Math.min(Math.max(v, 0), 100) / 100) * ph;
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.stroke();
  }
}
