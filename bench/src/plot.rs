//! Labelled line charts into PNG: plotters draws into an RGB buffer, the `png`
//! crate encodes it. Text is drawn with ab_glyph from a small embedded DejaVu
//! Sans subset (assets/), so no system fonts or font libraries are needed.

use anyhow::anyhow;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Reference lines (ideal, target) are drawn dashed and grey.
    pub reference: bool,
    /// A dot on every measured point.
    pub markers: bool,
}

impl Series {
    /// Measured points joined by lines, each with a dot.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
            reference: false,
            markers: true,
        }
    }

    /// A count sampled over time, drawn as steps: it holds until the next
    /// sample instead of seeming to grow between samples.
    pub fn progress(name: impl Into<String>, samples: Vec<(f64, f64)>) -> Series {
        let mut points = Vec::with_capacity(samples.len() * 2);
        for (x, y) in samples {
            if let Some(&(_, previous)) = points.last()
                && previous != y
            {
                points.push((x, previous));
            }
            points.push((x, y));
        }
        Series {
            name: name.into(),
            points,
            reference: false,
            markers: false,
        }
    }

    pub fn reference(name: impl Into<String>, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
            reference: true,
            markers: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Logarithmic x axis (thread counts, buffer sizes).
    pub log_x: bool,
    pub series: Vec<Series>,
}

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The embedded font is a known-good file; if it ever failed to parse,
        // drawing text would report the error when the chart is drawn.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 620;

/// Draws `chart` into a 1000×620 PNG at `path`.
pub fn draw(path: &Path, chart: &Chart) -> anyhow::Result<()> {
    let mut pixels = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    render(&mut pixels, chart)?;
    let file = std::fs::File::create(path).map_err(|e| anyhow!("create {}: {e}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), WIDTH, HEIGHT);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&pixels)?;
    writer.finish()?;
    Ok(())
}

fn render(pixels: &mut [u8], chart: &Chart) -> anyhow::Result<()> {
    register_font();
    let points = || chart.series.iter().flat_map(|s| s.points.iter().copied());
    if points().next().is_none() {
        return Err(anyhow!("nothing to plot in `{}`", chart.title));
    }
    let (mut x0, mut x1) = points().fold((f64::MAX, f64::MIN), |(lo, hi), (x, _)| (lo.min(x), hi.max(x)));
    let y1 = points().fold(0.0f64, |hi, (_, y)| hi.max(y)) * 1.08;
    let y1 = if y1 > 0.0 { y1 } else { 1.0 };
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if chart.log_x {
        x0 = x0.max(1e-9);
        x0 /= 1.15;
        x1 *= 1.15;
    }

    let root = BitMapBackend::with_buffer(pixels, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&chart.title, ("sans-serif", 24))
        .margin(18)
        .x_label_area_size(50)
        .y_label_area_size(90);

    // Two coordinate types, one body: a macro keeps the drawing code in one place.
    macro_rules! body {
        ($ctx:expr) => {{
            let mut ctx = $ctx;
            ctx.configure_mesh()
                .x_desc(chart.x_label.as_str())
                .y_desc(chart.y_label.as_str())
                .label_style(("sans-serif", 15))
                .axis_desc_style(("sans-serif", 17))
                .light_line_style(RGBColor(235, 235, 235))
                .x_label_formatter(&|x: &f64| short(*x))
                .y_label_formatter(&|y: &f64| short(*y))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            let mut color_index = 0;
            for series in &chart.series {
                // Later lines are thinner, so a line drawn over an equal one still shows beneath.
                let (color, width) = if series.reference {
                    (RGBColor(110, 110, 110), 2)
                } else {
                    color_index += 1;
                    let width = if color_index == 1 { 6 } else { 3 };
                    (PALETTE[(color_index - 1) % PALETTE.len()], width)
                };
                let style = ShapeStyle {
                    color: color.to_rgba(),
                    filled: false,
                    stroke_width: width,
                };
                let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 24, y)], style);
                if series.reference {
                    ctx.draw_series(DashedLineSeries::new(series.points.iter().copied(), 8, 6, style))
                        .map_err(|e| anyhow!("{e}"))?
                        .label(series.name.as_str())
                        .legend(legend);
                } else {
                    ctx.draw_series(LineSeries::new(series.points.iter().copied(), style))
                        .map_err(|e| anyhow!("{e}"))?
                        .label(series.name.as_str())
                        .legend(legend);
                    if series.markers {
                        ctx.draw_series(series.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                            .map_err(|e| anyhow!("{e}"))?;
                    }
                }
            }
            ctx.configure_series_labels()
                .position(SeriesLabelPosition::LowerRight)
                .label_font(("sans-serif", 15))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
        }};
    }

    if chart.log_x {
        // Ticks at the measured x values (thread counts, bounds): a log axis's
        // own ticks crowd and label 1.0, 2.0, … 9.0, 10.0.
        let mut ticks: Vec<f64> = chart
            .series
            .iter()
            .filter(|s| !s.reference)
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        ticks.sort_by(f64::total_cmp);
        ticks.dedup();
        body!(
            builder
                .build_cartesian_2d((x0..x1).log_scale().with_key_points(ticks), 0.0..y1)
                .map_err(|e| anyhow!("{e}"))?
        );
    } else {
        body!(
            builder
                .build_cartesian_2d(x0..x1, 0.0..y1)
                .map_err(|e| anyhow!("{e}"))?
        );
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Axis numbers: 1500 → "1.5k", 2000000 → "2M".
fn short(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.1}", v / 1e3)))
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        trim(format!("{v:.2}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_numbers() {
        assert_eq!(short(0.0), "0");
        assert_eq!(short(1500.0), "1.5k");
        assert_eq!(short(2_000_000.0), "2M");
        assert_eq!(short(0.95), "0.95");
    }

    #[test]
    fn draws_a_png_with_text() {
        let dir = crate::workload::temp_dir("plot").unwrap();
        let path = dir.path().join("t.png");
        let chart = Chart {
            title: "throughput ≥ target".into(),
            x_label: "threads per task (T)".into(),
            y_label: "records/s".into(),
            log_x: true,
            series: vec![
                Series::line("offset", vec![(1.0, 500.0), (2.0, 990.0), (4.0, 1900.0)]),
                Series::reference("ideal", vec![(1.0, 500.0), (4.0, 2000.0)]),
            ],
        };
        draw(&path, &chart).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
