//! PNG plots for `kestrel bench`: per-position acceptance and throughput against concurrency.

use super::bench::MethodResult;
use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use std::path::Path;

/// TrueType fonts commonly present; plots need one for their labels.
const FONT_PATHS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

fn register_font() -> Result<()> {
    for p in FONT_PATHS {
        if let Ok(bytes) = std::fs::read(p) {
            // The plotting library keeps fonts for the life of the process.
            let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok() {
                return Ok(());
            }
        }
    }
    bail!("no TrueType font found for plot labels (install fonts-dejavu-core)")
}

const COLORS: [RGBColor; 4] = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(214, 39, 40)];

pub fn write_plots(dir: &Path, results: &[MethodResult]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    register_font()?;
    acceptance_plot(&dir.join("acceptance_per_position.png"), results)?;
    throughput_plot(&dir.join("throughput_vs_concurrency.png"), results)?;
    Ok(())
}

fn acceptance_plot(path: &Path, results: &[MethodResult]) -> Result<()> {
    let max_c = results.iter().map(|r| r.concurrency).max().unwrap_or(1);
    let series: Vec<(&str, Vec<f64>)> = results
        .iter()
        .filter(|r| r.concurrency == max_c && r.method != "none")
        .map(|r| (r.method.as_str(), r.spec["per_position"].as_array().map(|a| a.iter().filter_map(|v| v.as_f64()).collect()).unwrap_or_default()))
        .collect();
    let k = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(1);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Acceptance per draft position (concurrency {max_c})"), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..(k as f64 - 0.5).max(0.5), 0f64..1.05)?;
    chart.configure_mesh().x_desc("draft position").y_desc("fraction accepted").draw()?;
    for (i, (name, values)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(values.iter().enumerate().map(|(j, v)| (j as f64, *v)), color.stroke_width(2)).point_size(4))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn throughput_plot(path: &Path, results: &[MethodResult]) -> Result<()> {
    let mut methods: Vec<&str> = results.iter().map(|r| r.method.as_str()).collect();
    methods.dedup();
    let max_c = results.iter().map(|r| r.concurrency).max().unwrap_or(1) as f64;
    let max_t = results.iter().map(|r| r.output_tokens_per_s).fold(1.0, f64::max);
    let root = BitMapBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Output throughput against concurrency", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..max_c * 1.1, 0f64..max_t * 1.1)?;
    chart.configure_mesh().x_desc("concurrent requests").y_desc("output tokens/s").draw()?;
    for (i, m) in methods.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts: Vec<(f64, f64)> = results.iter().filter(|r| r.method == *m).map(|r| (r.concurrency as f64, r.output_tokens_per_s)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)).point_size(4))?
            .label(*m)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present().with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
