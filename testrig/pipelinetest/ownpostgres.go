package pipelinetest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresServer is a PostgreSQL server of its own (see StartPostgres):
// for tests and fault-injection runs that refuse connections, stop or
// fail over the database without touching the shared one.
type PostgresServer struct {
	// Port is its loopback port.
	Port int
	dir  string
	bin  string
	cred *syscall.Credential
}

// URL connects to database on the server as the superuser postgres.
func (s *PostgresServer) URL(database string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", s.Port, database)
}

// StartPostgres initialises a cluster in a temporary directory with the
// machine's PostgreSQL (initdb, trust authentication, wal_level=logical)
// and starts it on a free loopback port; settings ("wal_level=replica")
// are passed as -c options after Ferry's, so they win. As root it runs the
// server as the postgres user, which PostgreSQL requires. Stop removes
// everything.
func StartPostgres(ctx context.Context, settings ...string) (*PostgresServer, error) {
	bin, err := postgresBin()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "ferry-pg-")
	if err != nil {
		return nil, err
	}
	s := &PostgresServer{dir: dir, bin: bin}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, fmt.Errorf("running PostgreSQL as root needs the postgres user: %w", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	if out, err := s.run(ctx, "initdb", "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	if err := s.start(ctx, settings...); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("starting PostgreSQL: %w", err)
	}
	return s, nil
}

// start starts the cluster in s's directory on its port (a free loopback
// port the first time), with Ferry's settings and then settings
// ("name=value"), which win.
func (s *PostgresServer) start(ctx context.Context, settings ...string) error {
	if s.Port == 0 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return err
		}
		s.Port = ln.Addr().(*net.TCPAddr).Port
		_ = ln.Close()
	}
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c wal_level=logical -c max_connections=200", s.Port, s.dir)
	// pg_ctl hands -o to a shell: each setting goes quoted, so that a value
	// with a space or a shell character ("log_line_prefix=%m|%p ") reaches
	// the server whole instead of piping its log away.
	for _, set := range settings {
		opts += " -c '" + strings.ReplaceAll(set, "'", `'\''`) + "'"
	}
	if out, err := s.run(ctx, "pg_ctl", "-D", s.data(), "-l", filepath.Join(s.dir, "server.log"), "-o", opts, "-w", "-t", "60", "start"); err != nil {
		logs, _ := s.Log()
		return fmt.Errorf("%w\n%s\n%s", err, out, logs)
	}
	return nil
}

// OwnPostgres starts a PostgreSQL server of the test's own (StartPostgres,
// with settings), stopped and removed when the test ends.
func OwnPostgres(t testing.TB, settings ...string) *PostgresServer {
	t.Helper()
	skipShort(t)
	s, err := StartPostgres(context.Background(), settings...)
	if err != nil {
		t.Fatalf("this test runs a PostgreSQL server of its own: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stopping the test's PostgreSQL: %v", err)
		}
	})
	return s
}

// Exec runs sql on database as the superuser.
func (s *PostgresServer) Exec(ctx context.Context, database, sql string, args ...any) error {
	conn, err := pgx.Connect(ctx, s.URL(database))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql, args...)
	return err
}

// Log is what the server has written to its log so far.
func (s *PostgresServer) Log() ([]byte, error) {
	return os.ReadFile(filepath.Join(s.dir, "server.log"))
}

// Stop stops the server at once, if it runs, and removes its files.
func (s *PostgresServer) Stop() error {
	err := s.Halt()
	return errors.Join(err, os.RemoveAll(s.dir))
}

// Halt stops the server at once (a crash: no checkpoint, connections cut),
// keeping its files. Halting a stopped server does nothing.
func (s *PostgresServer) Halt() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := s.run(ctx, "pg_ctl", "-D", s.data(), "status"); err != nil {
		return nil // not running
	}
	out, err := s.run(ctx, "pg_ctl", "-D", s.data(), "-m", "immediate", "-w", "stop")
	if err != nil {
		return fmt.Errorf("pg_ctl stop: %w: %s", err, out)
	}
	return nil
}

// Restart starts a halted server again on its port, as a supervisor
// brings a crashed server back: its clients reconnect to the same address.
// The settings it was first started with are not passed again.
func (s *PostgresServer) Restart(ctx context.Context) error {
	return s.start(ctx)
}

// StartStandby starts a streaming standby of s (pg_basebackup -R from it,
// into a directory of its own, on another free loopback port). With
// synchronous, s then waits for the standby's flush at every commit
// (synchronous_standby_names = '*'), so a commit the primary acknowledged
// is on the standby too.
func (s *PostgresServer) StartStandby(ctx context.Context, synchronous bool) (*PostgresServer, error) {
	dir, err := os.MkdirTemp("", "ferry-pg-standby-")
	if err != nil {
		return nil, err
	}
	st := &PostgresServer{dir: dir, bin: s.bin, cred: s.cred}
	if st.cred != nil {
		if err := os.Chown(dir, int(st.cred.Uid), int(st.cred.Gid)); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
	}
	if out, err := st.run(ctx, "pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(s.Port), "-U", "postgres", "-D", st.data(), "-R", "-X", "stream", "--no-sync"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("pg_basebackup: %w\n%s", err, out)
	}
	if err := st.start(ctx, "hot_standby=on"); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("starting the standby: %w", err)
	}
	// Streaming before anything is asked of it.
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		conn, err := pgx.Connect(ctx, s.URL("postgres"))
		if err == nil {
			err = conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&n)
			conn.Close(ctx)
		}
		if err == nil && n > 0 {
			break
		}
		if time.Now().After(deadline) {
			_ = st.Stop()
			return nil, fmt.Errorf("the standby never streamed: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if synchronous {
		if err := s.Exec(ctx, "postgres", `ALTER SYSTEM SET synchronous_standby_names = '*'`); err != nil {
			_ = st.Stop()
			return nil, err
		}
		if err := s.Exec(ctx, "postgres", `SELECT pg_reload_conf()`); err != nil {
			_ = st.Stop()
			return nil, err
		}
	}
	return st, nil
}

// Promote makes a standby the primary (pg_ctl promote), once it accepts writes.
func (s *PostgresServer) Promote(ctx context.Context) error {
	if out, err := s.run(ctx, "pg_ctl", "-D", s.data(), "-w", "-t", "60", "promote"); err != nil {
		return fmt.Errorf("pg_ctl promote: %w\n%s", err, out)
	}
	return nil
}

func (s *PostgresServer) data() string { return filepath.Join(s.dir, "data") }

func (s *PostgresServer) run(ctx context.Context, tool string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, filepath.Join(s.bin, tool), args...)
	cmd.Dir = s.dir
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	return cmd.CombinedOutput()
}

// postgresBin finds the server's programs: pg_config's bindir, else the
// newest /usr/lib/postgresql/*/bin (Debian keeps them off PATH).
func postgresBin() (string, error) {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dir := string(out[:len(out)-1])
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("no PostgreSQL server programs (initdb, pg_ctl) found: apt-get install postgresql")
}

func versionOf(bindir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(bindir)))
	return n
}
