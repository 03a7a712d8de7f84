//! The sweep as an SVG chart: delivered events/s per subscriber and latency
//! against the number of subscribers, side by side; kvgate's runs only (a
//! peer's are in the table and the JSON).

use std::fmt::Write;

use super::report::{Report, RunReport};
use super::subject::KVGATE;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 430.0;
const PLOT_TOP: f64 = 105.0;
const PLOT_HEIGHT: f64 = 260.0;
const PLOT_WIDTH: f64 = 360.0;
const BLUE: &str = "#1f77b4";
const RED: &str = "#d62728";
const GREY: &str = "#888888";

pub fn render(report: &Report) -> String {
    let runs: Vec<&RunReport> = report
        .runs
        .iter()
        .filter(|run| run.subject == KVGATE)
        .collect();
    let labels: Vec<String> = runs.iter().map(|run| run.subscribers.to_string()).collect();
    let column =
        |pick: fn(&RunReport) -> f64| -> Vec<f64> { runs.iter().map(|run| pick(run)).collect() };
    let published = column(|run| run.published_events_per_s);
    let mean = column(|run| run.delivered_events_per_s_mean);
    let min = column(|run| run.delivered_events_per_s_min);
    let p50 = column(|run| run.latency_ms.p50);
    let p99 = column(|run| run.latency_ms.p99);

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15">kvgate-bench: {}, {} CPUs ({})</text>"#,
        WIDTH / 2.0,
        escape(&report.rate_label()),
        report.machine.cpus,
        escape(&report.machine.cpu_model),
    );

    let throughput = Panel {
        left: 80.0,
        title: "delivered events/s per subscriber",
        labels: &labels,
        scale: Scale::linear(published.iter().chain(&mean).copied().fold(0.0, f64::max)),
    };
    throughput.frame(&mut svg);
    throughput.series(&mut svg, &published, (GREY, true), "published", 0);
    throughput.series(&mut svg, &mean, (BLUE, false), "mean", 1);
    throughput.series(&mut svg, &min, (BLUE, true), "slowest subscriber", 2);

    // Logarithmic: a stall of a few hundred milliseconds in one run would
    // flatten the others' sub-millisecond figures on a linear axis.
    let latency = Panel {
        left: 560.0,
        title: "latency, publish to receive (ms)",
        labels: &labels,
        scale: Scale::log(p50.iter().chain(&p99).copied()),
    };
    latency.frame(&mut svg);
    latency.series(&mut svg, &p99, (RED, false), "p99", 0);
    latency.series(&mut svg, &p50, (RED, true), "p50", 1);

    svg.push_str("</svg>\n");
    svg
}

struct Panel<'a> {
    left: f64,
    title: &'a str,
    labels: &'a [String],
    scale: Scale,
}

/// How a panel maps values to heights.
enum Scale {
    /// From 0 to `max`, a gridline every `step`.
    Linear { max: f64, step: f64 },
    /// From 10^`low` to 10^`high`, a gridline at each power of ten.
    Log { low: i32, high: i32 },
}

impl Scale {
    /// A round top above `largest` and a step of 1, 2 or 5 times a power of
    /// ten, for four or five gridlines.
    fn linear(largest: f64) -> Self {
        if largest.is_nan() || largest <= 0.0 {
            return Self::Linear {
                max: 1.0,
                step: 0.25,
            };
        }
        let rough = largest / 4.0;
        let magnitude = 10f64.powf(rough.log10().floor());
        let step = [1.0, 2.0, 5.0, 10.0]
            .into_iter()
            .map(|factor| factor * magnitude)
            .find(|step| *step >= rough)
            .unwrap_or(10.0 * magnitude);
        Self::Linear {
            max: (largest / step).ceil() * step,
            step,
        }
    }

    /// The powers of ten around the positive `values`, from 0.01 up.
    fn log(values: impl Iterator<Item = f64>) -> Self {
        let (smallest, largest) = values
            .filter(|value| *value > 0.0)
            .fold((f64::INFINITY, 0.0f64), |(low, high), value| {
                (low.min(value), high.max(value))
            });
        if largest == 0.0 {
            return Self::Log { low: -1, high: 1 };
        }
        let low = (smallest.log10().floor() as i32).max(-2);
        let high = (largest.log10().ceil() as i32).max(low + 1);
        Self::Log { low, high }
    }

    /// Height of `value` as a fraction of the plot's.
    fn fraction(&self, value: f64) -> f64 {
        match *self {
            Self::Linear { max, .. } => value / max,
            Self::Log { low, high } => {
                let floor = 10f64.powi(low);
                (value.max(floor).log10() - f64::from(low)) / f64::from(high - low)
            }
        }
    }

    fn gridlines(&self) -> Vec<f64> {
        match *self {
            Self::Linear { max, step } => {
                let count = (max / step).round() as u32;
                (0..=count).map(|tick| step * f64::from(tick)).collect()
            }
            Self::Log { low, high } => (low..=high).map(|power| 10f64.powi(power)).collect(),
        }
    }
}

impl Panel<'_> {
    fn x(&self, index: usize) -> f64 {
        self.left + PLOT_WIDTH * (index as f64 + 0.5) / self.labels.len().max(1) as f64
    }

    fn y(&self, value: f64) -> f64 {
        PLOT_TOP + PLOT_HEIGHT * (1.0 - self.scale.fraction(value))
    }

    fn frame(&self, svg: &mut String) {
        let (left, right, bottom) = (self.left, self.left + PLOT_WIDTH, PLOT_TOP + PLOT_HEIGHT);
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="48" text-anchor="middle" font-size="13">{}</text>"#,
            left + PLOT_WIDTH / 2.0,
            escape(self.title)
        );
        for value in self.scale.gridlines() {
            let y = self.y(value);
            let _ = writeln!(
                svg,
                r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                left - 6.0,
                y + 4.0,
                tick_label(value)
            );
        }
        for (index, label) in self.labels.iter().enumerate() {
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{label}</text>"#,
                self.x(index),
                bottom + 18.0
            );
        }
        let _ = writeln!(
            svg,
            r#"<polyline points="{left},{PLOT_TOP} {left},{bottom} {right},{bottom}" fill="none" stroke="black"/><text x="{}" y="{}" text-anchor="middle">subscribers</text>"#,
            left + PLOT_WIDTH / 2.0,
            bottom + 38.0
        );
    }

    /// A line with a dot per run, and its entry in row `row` of the legend.
    fn series(
        &self,
        svg: &mut String,
        values: &[f64],
        (color, dashed): (&str, bool),
        name: &str,
        row: usize,
    ) {
        let dash = if dashed {
            r#" stroke-dasharray="5,4""#
        } else {
            ""
        };
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .map(|(index, value)| format!("{:.1},{:.1}", self.x(index), self.y(*value)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            points.join(" ")
        );
        for point in &points {
            let (x, y) = point.split_once(',').unwrap_or_default();
            let _ = writeln!(svg, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
        }
        let legend_x = self.left + PLOT_WIDTH - 150.0;
        let legend_y = 64.0 + 13.0 * row as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{legend_x}" y1="{legend_y}" x2="{}" y2="{legend_y}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
            legend_x + 22.0,
            legend_x + 28.0,
            legend_y + 4.0,
            escape(name)
        );
    }
}

fn tick_label(value: f64) -> String {
    let (scaled, suffix) = if value >= 1e6 {
        (value / 1e6, "M")
    } else if value >= 1e3 {
        (value / 1e3, "k")
    } else {
        (value, "")
    };
    let text = format!("{scaled:.2}");
    format!(
        "{}{suffix}",
        text.trim_end_matches('0').trim_end_matches('.')
    )
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::super::report::tests::{config, machine, run};
    use super::*;

    fn linear(largest: f64) -> (f64, f64) {
        match Scale::linear(largest) {
            Scale::Linear { max, step } => (max, step),
            Scale::Log { .. } => unreachable!(),
        }
    }

    #[test]
    fn linear_axes_end_on_round_numbers_above_the_data() {
        assert_eq!(linear(18_700.0), (20_000.0, 5_000.0));
        assert_eq!(linear(1.3), (1.5, 0.5));
        assert_eq!(linear(0.0), (1.0, 0.25));
        assert_eq!(tick_label(25_000.0), "25k");
        assert_eq!(tick_label(1.5), "1.5");
        assert_eq!(tick_label(2_500_000.0), "2.5M");
    }

    #[test]
    fn log_axes_span_the_powers_of_ten_around_the_data() {
        let scale = Scale::log([0.21, 3.5, 340.0, 0.0].into_iter());
        assert!(matches!(scale, Scale::Log { low: -1, high: 3 }));
        assert_eq!(scale.gridlines(), [0.1, 1.0, 10.0, 100.0, 1000.0]);
        assert_eq!(scale.fraction(10.0), 0.5);
        assert_eq!(scale.fraction(0.0), 0.0);
        assert!(matches!(
            Scale::log([2.0, 2.0].into_iter()),
            Scale::Log { low: 0, high: 1 }
        ));
    }

    #[test]
    fn the_chart_has_a_point_per_run_and_series() {
        let runs = vec![run(1, 0.5, 20_000.0, 0.5), run(8, 1.5, 19_000.0, 1.0)];
        let svg = render(&Report::new(machine(), config(20_000), runs));
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        // Five series of two runs each.
        assert_eq!(svg.matches("<circle").count(), 10);
        assert!(svg.contains(">slowest subscriber</text>"));
    }
}
