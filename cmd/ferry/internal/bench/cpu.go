package bench

import (
	"math"
	"os"
	"strconv"
	"strings"
)

// CPU as the scenarios measure it: the machine's, from /proc/stat, and
// PostgreSQL's, RabbitMQ's and this process's, from /proc/<pid>/stat.

// cpuSample is the first line of /proc/stat: jiffies busy and in total.
type cpuSample struct{ busy, total uint64 }

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	fields := strings.Fields(line)
	var s cpuSample
	for i, f := range fields[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		s.total += v
		if i != 3 && i != 4 { // idle, iowait
			s.busy += v
		}
	}
	return s
}

// busySince is the busy share of the CPU between s0 and s (0 where unknown).
func (s cpuSample) busySince(s0 cpuSample) float64 {
	if s.total <= s0.total {
		return 0
	}
	return math.Round(1000*float64(s.busy-s0.busy)/float64(s.total-s0.total)) / 1000
}

// serverCPU is the CPU time (user + system, jiffies of 10 ms) of the
// processes named postgres and beam.smp (RabbitMQ) now alive, and of this
// process: with readCPU, where the machine's time goes during a run.
// Backends that exit between two readings take their time with them, so
// the database's share is a lower bound.
type serverCPU struct{ postgres, rabbitmq, self uint64 }

// cpuPerEvent is the CPU the machine, PostgreSQL, RabbitMQ and this
// process (under self's name) spent per event between two readings, in µs.
func cpuPerEvent(cpu0, cpu1 cpuSample, srv0, srv1 serverCPU, events int, self string) map[string]any {
	// Jiffies are 10 ms: 10,000 µs each.
	per := func(jiffies uint64) float64 { return math.Round(10*float64(jiffies)*10_000/float64(events)) / 10 }
	return map[string]any{"all": per(cpu1.busy - cpu0.busy), "postgresql": per(srv1.postgres - srv0.postgres),
		"rabbitmq": per(srv1.rabbitmq - srv0.rabbitmq), self: per(srv1.self - srv0.self)}
}

func readServerCPU() serverCPU {
	var s serverCPU
	dirs, _ := os.ReadDir("/proc")
	self := strconv.Itoa(os.Getpid())
	for _, d := range dirs {
		if d.Name()[0] < '0' || d.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		open, end := strings.IndexByte(string(b), '('), strings.LastIndexByte(string(b), ')')
		if open < 0 || end < open {
			continue
		}
		comm := string(b[open+1 : end])
		fields := strings.Fields(string(b[end+1:]))
		if len(fields) < 15 {
			continue
		}
		utime, _ := strconv.ParseUint(fields[11], 10, 64)
		stime, _ := strconv.ParseUint(fields[12], 10, 64)
		// A server's own children that exited (a PostgreSQL backend whose
		// connection closed) take their CPU with them, unless it is counted
		// where the parent reaped them: the postmaster's cutime and
		// cstime. Without them a window in which sessions closed could
		// read less database CPU than it used, even none.
		cutime, _ := strconv.ParseUint(fields[13], 10, 64)
		cstime, _ := strconv.ParseUint(fields[14], 10, 64)
		switch {
		case d.Name() == self:
			s.self += utime + stime
		case comm == "postgres":
			s.postgres += utime + stime + cutime + cstime
		case comm == "beam.smp":
			s.rabbitmq += utime + stime + cutime + cstime
		}
	}
	return s
}
